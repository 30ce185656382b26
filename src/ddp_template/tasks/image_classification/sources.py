"""Image data sets, each described by a small class: what it holds and how to split it.

A source is cheap to construct (no data is read, at most a few image headers), so the config
check can build it before any worker starts and reject a bad `root` or option with a clear
message. Each source also says its input size (the model's stem follows it) and whether its
samples are decoded on the CPU one by one (then loader workers pay off; see conf/data/).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from torch.utils.data import Dataset, Subset, TensorDataset
from torchvision import datasets, transforms

from ddp_template.data import Splits, check_fraction, check_held_out, split_indices
from ddp_template.errors import ConfigError

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp"}


@dataclass
class Digits:
    """scikit-learn's bundled 8x8 handwritten digits (1,797 images): no download."""

    val_fraction: float = 0.1
    test_fraction: float = 0.2
    split_seed: int = 0
    num_classes: int = 10
    in_channels: int = 1
    # Tensors in memory: nothing to decode, loading in the training process is fastest.
    decoded_per_sample = False
    input_size = 8

    def __post_init__(self) -> None:
        check_held_out(self.val_fraction, self.test_fraction)

    def describe_input(self) -> str:
        return "8x8 px, 1 channel (scikit-learn's digits)"

    def splits(self) -> Splits:
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        # Mean and spread of the pixel values over the whole data set.
        images = (images - 0.3) / 0.4
        labels = torch.tensor(digits.target, dtype=torch.long)
        full = TensorDataset(images, labels)
        train, val, test = split_indices(
            len(full), self.val_fraction, self.test_fraction, self.split_seed
        )
        return Subset(full, train), Subset(full, val), Subset(full, test)


def _cifar10_class(verify: bool) -> type[datasets.CIFAR10]:
    """torchvision's CIFAR10, with the MD5 checks of the official files made optional
    (torchvision checks a file's existence alone when its MD5 is None)."""
    if verify:
        return datasets.CIFAR10
    base = datasets.CIFAR10
    return type(
        "CIFAR10Unverified",
        (base,),
        {
            "train_list": [[name, None] for name, _ in base.train_list],
            "test_list": [[name, None] for name, _ in base.test_list],
            "meta": {**base.meta, "md5": None},
        },
    )


CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


@dataclass
class CIFAR10:
    """CIFAR-10 in its python-pickle format, downloaded into `root` by torchvision."""

    root: str = "data"
    download: bool = True
    verify: bool = True
    val_fraction: float = 0.1
    split_seed: int = 0
    augment: bool = True
    num_classes: int = 10
    in_channels: int = 3
    # Arrays in memory, but every sample goes through PIL and the transforms one by one.
    decoded_per_sample = True
    input_size = 32

    def __post_init__(self) -> None:
        check_fraction("val_fraction", self.val_fraction)
        folder = Path(self.root) / datasets.CIFAR10.base_folder
        if not self.download and not folder.is_dir():
            raise ConfigError(
                "data.root",
                self.root,
                f"no {datasets.CIFAR10.base_folder}/ folder there and data.download=false",
                "point data.root at the folder holding cifar-10-batches-py/ or set data.download=true",
            )

    def describe_input(self) -> str:
        return "32x32 px, 3 channels (CIFAR-10's size)"

    def prepare(self) -> None:
        """Download once per node (Lightning calls this on local rank 0 only)."""
        self._dataset(train=True, transform=None, download=self.download)
        self._dataset(train=False, transform=None, download=self.download)

    def _dataset(self, train: bool, transform, download: bool = False) -> datasets.CIFAR10:
        dataset_class = _cifar10_class(self.verify)
        return dataset_class(self.root, train=train, transform=transform, download=download)

    def splits(self) -> Splits:
        normalize = [transforms.ToTensor(), transforms.Normalize(CIFAR_MEAN, CIFAR_STD)]
        augment = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()]
        train_tf = transforms.Compose((augment if self.augment else []) + normalize)
        eval_tf = transforms.Compose(normalize)
        train_full = self._dataset(train=True, transform=train_tf)
        val_full = self._dataset(train=True, transform=eval_tf)
        train, val, _ = split_indices(len(train_full), self.val_fraction, 0.0, self.split_seed)
        test = self._dataset(train=False, transform=eval_tf)
        return Subset(train_full, train), Subset(val_full, val), test


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


# Side (px) that large images are resized and cropped to by default: ImageNet's training size.
LARGE_IMAGE_SIZE = 224
# Image headers read to find a folder's image size (PIL reads a header without decoding).
SIZE_SAMPLE_FILES = 16


@dataclass
class ImageFolder:
    """Class sub-folders of images, or an ImageNet layout with train/ and val/ inside."""

    root: str = ""
    # None: the images' own size (the median shorter side of a few files), at most 224 px.
    image_size: int | None = None
    val_fraction: float = 0.1
    test_fraction: float = 0.1
    split_seed: int = 0
    augment: bool = True
    in_channels: int = 3
    # Every sample is a file to read and decode (JPEG, PNG, ...): loader workers pay off.
    decoded_per_sample = True

    def __post_init__(self) -> None:
        check_held_out(self.val_fraction, self.test_fraction)
        root = Path(self.root)
        if not root.is_dir():
            raise ConfigError(
                "data.root",
                self.root,
                "a folder of class sub-folders (root/<class>/<image>) or root/train + root/val",
                "pass data.root=/path/to/images",
            )
        if not self._classes():
            raise ConfigError(
                "data.root",
                self.root,
                "a folder with at least one class sub-folder holding images; found none",
                "check the path, or arrange the images as root/<class>/<image>.jpg",
            )
        if len(self._classes()) == 1:
            raise ConfigError(
                "data.root",
                self.root,
                "a folder with at least two class sub-folders holding images (a classifier "
                f"of one class has nothing to learn); found one: {self._classes()[0]}",
                "add a sub-folder of images for each other class (root/<class>/<image>.jpg)",
            )
        size = self.image_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ConfigError(
                "data.image_size",
                size,
                "a side in pixels >= 1, or null for the images' own size (at most "
                f"{LARGE_IMAGE_SIZE} px)",
                "e.g. data.image_size=224, or leave it out",
            )

    @cached_property
    def native_size(self) -> int:
        """The median shorter side of up to 16 images, taken from classes across the folder."""
        classes = self._classes()
        top = self._split_roots[0] if self._split_roots else Path(self.root)
        step = max(1, len(classes) // SIZE_SAMPLE_FILES)
        sides = []
        for name in classes[::step][:SIZE_SAMPLE_FILES]:
            for file in sorted((top / name).iterdir()):
                if file.suffix.lower() in IMAGE_SUFFIXES:
                    sides.append(_shorter_side(file, self.root))
                    break
        return int(statistics.median(sides))

    @property
    def input_size(self) -> int:
        """The side images are resized and cropped to."""
        if self.image_size is not None:
            return self.image_size
        return min(self.native_size, LARGE_IMAGE_SIZE)

    def describe_input(self) -> str:
        size, native = self.input_size, self.native_size
        if self.image_size is not None:
            why = f"data.image_size; the images are about {native} px"
        elif size == native:
            why = "the images' own size"
        else:
            why = f"the images are about {native} px: resized to ImageNet's {size} px"
        return f"{size}x{size} px, 3 channels ({why})"

    @property
    def _split_roots(self) -> tuple[Path, Path] | None:
        train, val = Path(self.root) / "train", Path(self.root) / "val"
        return (train, val) if train.is_dir() and val.is_dir() else None

    def _classes(self) -> list[str]:
        top = self._split_roots[0] if self._split_roots else Path(self.root)
        return sorted(
            d.name
            for d in top.iterdir()
            if d.is_dir() and any(f.suffix.lower() in IMAGE_SUFFIXES for f in d.iterdir())
        )

    @property
    def num_classes(self) -> int:
        return len(self._classes())

    def check_files(self) -> None:
        """Every PNG and JPEG file whole, before any worker starts: a truncated one would
        fail mid-epoch, deep in a loader worker. Reads the last bytes of each file (their
        end marker), not the images: 2.2-2.6 s for 50,000 files here (local disk, files
        in the page cache, a shared 2-core machine)."""
        top = Path(self.root)
        for path in sorted(top.rglob("*")):
            if path.suffix.lower() in IMAGE_SUFFIXES and not _ends_whole(path):
                raise ConfigError(
                    "data.root",
                    self.root,
                    f"a folder of complete images; {path} is cut short (its end marker is "
                    "missing: a download or a copy that did not finish)",
                    "replace that file with a whole copy, or remove it",
                )

    def splits(self) -> Splits:
        size = self.input_size
        normalize = [transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
        resize = [transforms.Resize(size), transforms.CenterCrop(size)]
        augment = [transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip()]
        train_tf = transforms.Compose((augment if self.augment else resize) + normalize)
        eval_tf = transforms.Compose(resize + normalize)
        rgb = _rgb_loader
        if self._split_roots:
            train_root, val_root = self._split_roots
            train = datasets.ImageFolder(str(train_root), transform=train_tf, loader=rgb)
            val = datasets.ImageFolder(str(val_root), transform=eval_tf, loader=rgb)
            return train, val, val
        train_full = datasets.ImageFolder(self.root, transform=train_tf, loader=rgb)
        eval_full = datasets.ImageFolder(self.root, transform=eval_tf, loader=rgb)
        train, val, test = split_indices(
            len(train_full), self.val_fraction, self.test_fraction, self.split_seed
        )
        return Subset(train_full, train), Subset(eval_full, val), Subset(eval_full, test)


def _shorter_side(path: Path, root: str) -> int:
    from PIL import Image

    try:
        with Image.open(path) as image:
            return min(image.size)
    except OSError as err:
        raise ConfigError(
            "data.root",
            root,
            f"a folder of readable images; {path} is not ({err})",
            "remove or replace that file",
        ) from None


# The last bytes of a whole file: PNG's IEND chunk (with its CRC) and JPEG's EOI marker
# (some cameras write padding after it, hence a window).
_PNG_END = b"IEND\xaeB`\x82"
_JPEG_END = b"\xff\xd9"
_JPEG_TAIL = 4096


def _ends_whole(path: Path) -> bool:
    """False for a PNG or JPEG file without its end marker; True for other formats, whose
    damage the loader names instead."""
    suffix = path.suffix.lower()
    if suffix not in (".png", ".jpg", ".jpeg"):
        return True
    with path.open("rb") as file:
        file.seek(0, 2)
        size = file.tell()
        tail = _JPEG_TAIL if suffix != ".png" else len(_PNG_END)
        file.seek(max(0, size - tail))
        end = file.read()
    return end.endswith(_PNG_END) if suffix == ".png" else _JPEG_END in end


def _rgb_loader(path: str):
    from PIL import Image

    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (OSError, SyntaxError) as err:
        # The loader's traceback does not name the file otherwise.
        raise OSError(f"{path} cannot be decoded: {err}") from err


class _NoiseImages(Dataset):
    """Deterministic random images: sample i is the same on every rank and every epoch."""

    def __init__(self, size: int, shape: tuple[int, ...], num_classes: int, offset: int) -> None:
        self.size, self.shape, self.num_classes, self.offset = size, shape, num_classes, offset

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        generator = torch.Generator().manual_seed(self.offset + index)
        image = torch.randn(self.shape, generator=generator)
        label = int(torch.randint(self.num_classes, (), generator=generator))
        return image, label


@dataclass
class Synthetic:
    """Random images of a chosen size and class count, generated on the fly (benchmarks)."""

    num_samples: int = 2048
    # Size of the validation and of the test split.
    eval_samples: int = 256
    image_size: int = 32
    channels: int = 3
    num_classes: int = 10
    # Each sample is a small tensor drawn in the training process: nothing to decode.
    decoded_per_sample = False

    def __post_init__(self) -> None:
        for key in ("num_samples", "eval_samples", "image_size", "channels", "num_classes"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"data.{key}", value, "a whole number >= 1", f"e.g. data.{key}=32"
                )

    @property
    def in_channels(self) -> int:
        return self.channels

    @property
    def input_size(self) -> int:
        return self.image_size

    def describe_input(self) -> str:
        size = self.image_size
        return f"{size}x{size} px, {self.channels} channels (data.image_size, random images)"

    def splits(self) -> Splits:
        shape = (self.channels, self.image_size, self.image_size)
        train = _NoiseImages(self.num_samples, shape, self.num_classes, offset=0)
        val = _NoiseImages(self.eval_samples, shape, self.num_classes, offset=10**9)
        test = _NoiseImages(self.eval_samples, shape, self.num_classes, offset=2 * 10**9)
        return train, val, test
