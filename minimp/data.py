"""Datasets shipped with minimp, and the global batch order (a pure function of seed and step)."""

import gzip
from dataclasses import dataclass
from importlib import resources

import numpy as np
import numpy.typing as npt

from minimp.npz import read_arrays


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
        arrays = read_arrays(handle)
    return Dataset(
        name="digits",
        train_images=arrays["train_images"].astype(np.float32) / 16.0,
        train_labels=arrays["train_labels"].astype(np.int64),
        test_images=arrays["test_images"].astype(np.float32) / 16.0,
        test_labels=arrays["test_labels"].astype(np.int64),
    )


def global_batch_indices(seed: int, step: int, batch_size: int, dataset_size: int) -> np.ndarray:
    """Indices of the global batch of `step` (numbered from 1).

    Each epoch is a fresh permutation drawn from default_rng([seed, epoch]); batches are consecutive
    slices of it and the incomplete tail is dropped. Because the result depends only on (seed, step,
    batch_size, dataset_size), a resumed run, any number of ranks and any number of micro-batches
    all see the same global batches, with no generator state to carry around.
    """
    if not 0 < batch_size <= dataset_size:
        raise ValueError(
            f"batch size {batch_size} must lie in 1..{dataset_size} (the training set size)")
    batches_per_epoch = dataset_size // batch_size
    epoch, index = divmod(step - 1, batches_per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(dataset_size)
    return order[index * batch_size : (index + 1) * batch_size]


@dataclass
class TextDataset:
    """A character-level corpus: ids into `vocabulary`, split into training and validation."""

    name: str
    train: np.ndarray  # (N,) uint8 character ids
    validation: np.ndarray  # (M,) uint8 character ids
    vocabulary: str  # the distinct characters, sorted: id i stands for vocabulary[i]

    @property
    def vocab_size(self) -> int:
        return len(self.vocabulary)

    def encode(self, text: str) -> np.ndarray:
        """Character ids of text (int64); a character outside the vocabulary is an error."""
        return encode(text, self.vocabulary)

    def decode(self, ids: npt.ArrayLike) -> str:
        return decode(ids, self.vocabulary)


def _code_points(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)


def encode(text: str, vocabulary: str) -> np.ndarray:
    """Character ids of text in a sorted vocabulary (int64), vectorised by binary search."""
    table, points = _code_points(vocabulary), _code_points(text)
    ids = np.minimum(np.searchsorted(table, points), len(table) - 1)
    unknown = table[ids] != points
    if unknown.any():
        raise ValueError(f"encode: {text[int(np.argmax(unknown))]!r} is not in the vocabulary")
    return ids.astype(np.int64)


def decode(ids: npt.ArrayLike, vocabulary: str) -> str:
    """The text whose character ids these are."""
    return "".join(vocabulary[int(i)] for i in np.asarray(ids).reshape(-1))


def load_shakespeare() -> TextDataset:
    """Tiny shakespeare (1,115,394 characters, 65 distinct; see minimp/datasets/README.md), at
    character level as nanoGPT's shakespeare_char: vocabulary = the sorted distinct characters,
    the first 90% for training (1,003,854 characters), the last 10% for validation (111,540)."""
    packed = resources.files("minimp.datasets").joinpath("tinyshakespeare.txt.gz").read_bytes()
    text = gzip.decompress(packed).decode("utf-8")
    vocabulary = "".join(sorted(set(text)))
    ids = encode(text, vocabulary).astype(np.uint8)  # 65 ids fit a byte: 1.1 MB in memory
    split = int(0.9 * len(ids))
    return TextDataset("shakespeare", ids[:split], ids[split:], vocabulary)


def text_batch(data: np.ndarray, seed: int, step: int, batch_size: int,
               context: int) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of `step`: inputs (B, T) of `context` consecutive ids and targets (B, T),
    the ids one position later (the next character at each position), both int64.

    The B window starts are drawn uniformly (as nanoGPT's get_batch) from default_rng([seed,
    step]): the batch depends only on (seed, step, batch_size, context), so any number of ranks
    or micro-batches, and a resumed run, see the same windows. Row r of it is global sample r.
    """
    if not 0 < context < len(data):
        raise ValueError(f"context {context} must lie in 1..{len(data) - 1} (the data's length)")
    starts = np.random.default_rng([seed, step]).integers(0, len(data) - context, size=batch_size)
    window = starts[:, None] + np.arange(context)  # (B, T) positions in data
    return data[window].astype(np.int64), data[window + 1].astype(np.int64)
