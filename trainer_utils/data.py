"""Step-wise batch feeding from a global sample cursor, prefetched on a background thread.

Optimizer step s consumes global positions [c, c + accum * world * B) of the dataset's order, where c is the
cursor; rank r's micro-batch m takes positions c + (m * world + r) * B ... + B. The cursor (a sample count) is
what checkpoints store, so a resume with any world size continues from the same sample.
"""
from __future__ import annotations

import queue
import threading
from typing import Iterator

import torch


def host_batch(batch: tuple[torch.Tensor, ...], pin: bool) -> tuple[torch.Tensor, ...]:
    """The batch's tensors made contiguous and, for a GPU, pinned: pinned host memory lets the copy to the device
    run asynchronously, overlapping compute. Contiguous first: a dataset may return views (inputs and targets
    are two shifted slices of one row block), and pin_memory() keeps a view's strides, so the device copy would
    then make a fresh unpinned contiguous copy on the training thread, synchronously."""
    batch = tuple(t.contiguous() for t in batch)
    return tuple(t.pin_memory() for t in batch) if pin else batch


class StepFeeder:
    """Yields, for each optimizer step, this rank's list of micro-batches on the device: each the tuple of tensors
    the dataset's batch() returns ((inputs, targets), or more, e.g. DPO's reference log-probs)."""

    def __init__(self, dataset, batch_size: int, accumulation_steps: int, rank: int, world_size: int,
                 cursor: int, device: torch.device, prefetch: int = 2) -> None:
        self.dataset, self.batch_size, self.accum = dataset, batch_size, accumulation_steps
        self.rank, self.world_size, self.device = rank, world_size, device
        self.samples_per_step = batch_size * accumulation_steps * world_size
        self.cursor = cursor  # global position of the next step's first sample
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(cursor,), daemon=True)
        self._thread.start()

    def _read(self, start: int) -> tuple[list[tuple[torch.Tensor, ...]], int]:
        out, n_input = [], 0
        for m in range(self.accum):
            first = start + (m * self.world_size + self.rank) * self.batch_size
            indices = self.dataset.global_indices(first, self.batch_size)
            batch = self.dataset.batch(indices)
            n_input += self.dataset.input_tokens(indices)  # counted here, on the host: no device sync later
            out.append(host_batch(batch, pin=self.device.type == "cuda"))
        return out, n_input

    def _produce(self, start: int) -> None:
        try:
            while not self._stop.is_set():
                item = self._read(start)
                start += self.samples_per_step
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # surface data errors in the training thread
            self._queue.put(e)

    def next_step(self) -> tuple[list[tuple[torch.Tensor, ...]], int]:
        """This rank's micro-batches for the next step and their number of non-padding input tokens."""
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        micro, n_input = item
        self.cursor += self.samples_per_step
        # asynchronous copies from pinned memory on CUDA only: on MPS non_blocking copies can corrupt data
        # (pytorch#139550), and an unpinned CPU tensor gains nothing from them
        cuda = self.device.type == "cuda"
        micro = [tuple(t.to(self.device, non_blocking=cuda) for t in batch) for batch in micro]
        return micro, n_input

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def eval_batches(dataset, batch_size: int, max_batches: int, rank: int,
                 world_size: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """A fixed, unshuffled slice of the validation set, split across ranks, identical at every evaluation."""
    total = min(dataset.num_examples, max_batches * batch_size * world_size)
    for start in range(rank * batch_size, total, batch_size * world_size):
        indices = list(range(start, min(start + batch_size, total)))
        yield dataset.batch(indices)
