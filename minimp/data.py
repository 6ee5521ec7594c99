"""Datasets shipped with minimp, and the global batch order (a pure function of seed and step)."""

from dataclasses import dataclass
from importlib import resources

import numpy as np


@dataclass
class Dataset:
    name: str
    train_images: np.ndarray  # (N, features) float32
    train_labels: np.ndarray  # (N,) int64
    test_images: np.ndarray
    test_labels: np.ndarray

    def __post_init__(self) -> None:
        """Refuse data that cannot train: non-finite pixels, negative or non-integer labels,
        images and labels of different lengths."""
        for split in ("train", "test"):
            images, labels = getattr(self, f"{split}_images"), getattr(self, f"{split}_labels")
            if len(images) != len(labels):
                raise ValueError(f"{self.name}: {len(images)} {split} images, {len(labels)} labels")
            if not np.isfinite(images).all():
                raise ValueError(f"{self.name}: the {split} images hold inf or NaN")
            if labels.dtype.kind not in "iu" or (len(labels) and labels.min() < 0):
                raise ValueError(f"{self.name}: {split} labels must be integers >= 0")

    @property
    def features(self) -> int:
        return self.train_images.shape[1]

    @property
    def classes(self) -> int:
        return int(max(self.train_labels.max(), self.test_labels.max())) + 1


def load_digits() -> Dataset:
    """The 8x8 handwritten digits (1,797 images; see minimp/datasets/README.md for source and
    license), pixels scaled from 0..16 to 0..1, with the fixed 1,437 / 360 train/test split."""
    with resources.files("minimp.datasets").joinpath("digits.npz").open("rb") as handle:
        arrays = np.load(handle)
        return Dataset(
            name="digits",
            train_images=arrays["train_images"].astype(np.float32) / 16.0,
            train_labels=arrays["train_labels"].astype(np.int64),
            test_images=arrays["test_images"].astype(np.float32) / 16.0,
            test_labels=arrays["test_labels"].astype(np.int64),
        )


DATASETS = {"digits": load_digits}


def global_batch_indices(seed: int, step: int, batch_size: int, dataset_size: int) -> np.ndarray:
    """Indices of the global batch of `step` (numbered from 1).

    Each epoch is a fresh permutation drawn from default_rng([seed, epoch]); batches are consecutive
    slices of it and the incomplete tail is dropped. Because the result depends only on (seed, step,
    batch_size), a resumed run, any number of ranks and any number of micro-batches all see the same
    global batches, with no generator state to carry around.
    """
    if not 0 < batch_size <= dataset_size:
        raise ValueError(
            f"batch size {batch_size} must lie in 1..{dataset_size} (the training set size)"
        )
    batches_per_epoch = dataset_size // batch_size
    epoch, index = divmod(step - 1, batches_per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(dataset_size)
    return order[index * batch_size : (index + 1) * batch_size]
