"""Resuming, in one place: a run may be stopped at any step and must end as if it never was.

An interrupted run, from the signal to the finished job:

1. **The signal** (`preemption`): SLURM's USR2 before a time limit, `scancel --signal`, a
   scheduler's SIGTERM, Ctrl-C. The handler only notes it; the ranks agree on it at an
   optimizer step without a host sync, save at the same step, and the job is requeued
   (SLURM) or stops with the command that resumes it.
2. **The save** (`checkpoint_io`, `state`, `loader`, `attempts`): a checkpoint is complete
   on disk before it takes its name, the previous one kept beside it; it holds the weights,
   optimizer, schedulers and loop counters (Lightning), the training loader's place in the
   epoch's global sample order (`loader`), every rank's random-number and comm-hook state
   (`state`), and the attempts so far (`attempts`).
3. **The decision** (`decision`, `checkpoint_check`, `folder`, `agent_records`): a fresh start,
   a restart of the worker group, a requeue, `resume=true` on an old folder (`folder`:
   the config must match), or `ckpt_path` (`checkpoint_check`: complete, a training
   checkpoint, of this model). The newest complete checkpoint wins (`last.ckpt`, else
   `last.prev.ckpt`, said in one line). A first attempt that finds an earlier run's state
   in its folder (a job id used again) stops, naming the keys that differ; a restart with
   nothing usable stops unless `restart_from_scratch=true`. A worker tells a rejoin of its
   torchrun job from a rerun by the records agents leave (`agent_records`).
4. **The agreement** (`agreement`): once the process group is up, every rank's choice is
   compared with rank 0's; any difference stops all of them with the ranks and nodes named.
5. **The continuation** (`loader_position`, `state`): the loader hands back its position
   (at any world size or batch size: the rest of the epoch's order is dealt out again), the
   schedule is refitted to the resumed run, generators and hook state are restored.
6. **The record** (`attempts`): results.json's `attempts` says how each attempt began and
   its first step, so a resume is told from a retrain; `optuna_study` continues a stopped
   Optuna sweep in its own folder.
"""
