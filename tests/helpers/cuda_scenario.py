"""A GPU machine's way of counting CUDA devices, on any machine with a CUDA build of torch:
`python cuda_scenario.py <nvml|mig|no_nvml>` counts the devices as the launching process
does, picks the workers' start method, starts one worker that way and prints, as JSON, the
count, the method and whether that worker (and a forked one) could still use CUDA.

- nvml: NVML counts 2 GPUs (no CUDA call);
- mig: CUDA_VISIBLE_DEVICES names a MIG instance; torch skips NVML, the CUDA runtime counts;
- no_nvml: no NVML library; the CUDA runtime counts.

The runtime's count is the real call (it registers torch's fork handler, which is what makes
a later fork unusable for CUDA), reporting 2 GPUs where this machine has none.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys


def in_bad_fork(answer) -> None:
    import torch

    answer.put(torch.cuda._is_in_bad_fork())


def child_in_bad_fork(method: str) -> bool:
    context = multiprocessing.get_context(method)
    answer = context.Queue()
    process = context.Process(target=in_bad_fork, args=(answer,))
    process.start()
    result = answer.get(timeout=120)
    process.join()
    return result


def main(scenario: str, on: str) -> None:
    if scenario == "mig":
        os.environ["CUDA_VISIBLE_DEVICES"] = "MIG-7f2c1d9a-0b3e-5a61-9c4d-2e8f6a1b3c5d"
    import torch

    import ddp_template.train  # noqa: F401  (sets PYTORCH_NVML_BASED_CUDA_CHECK, as train.py)

    runtime_count = torch._C._cuda_getDeviceCount

    def counted_by_runtime() -> int:
        runtime_count()
        return 2

    def no_nvml() -> int:
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    torch._C._cuda_getDeviceCount = counted_by_runtime
    torch.cuda._raw_device_count_nvml = (lambda: 2) if scenario in ("nvml", "mig") else no_nvml

    from ddp_template.config.checks import resolve_accelerator, resolve_devices
    from ddp_template.launch.agent import worker_start_method
    from ddp_template.launch.packing import job_start_method, machine_gpus

    if on == "launch":
        accelerator = resolve_accelerator("gpu")
        devices = resolve_devices("auto", accelerator)
        method = worker_start_method(on_cuda=accelerator == "cuda")
    else:
        devices = len(machine_gpus())
        method = job_start_method(on_gpus=True)
    print(
        json.dumps(
            {
                "devices": devices,
                "method": method,
                "worker_in_bad_fork": child_in_bad_fork(method),
                "forked_in_bad_fork": child_in_bad_fork("fork"),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
