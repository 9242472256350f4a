"""Host <-> device copies that never wait for the device's queue.

On CUDA a blocking copy waits for every kernel queued before it. With async scheduling the host launches step N+1
while step N still runs (worker/step_in_flight.py), so every copy on the step's path goes through pinned host
memory without blocking: host -> device for the step's inputs and the sampler's per-row values, device -> host
for the sampled ids (with an event to wait on later). On CPU they are plain copies.
"""

from __future__ import annotations

import array

import torch


def host_int64(values: list[int]) -> torch.Tensor:
    """A CPU int64 tensor over a list, through array('q'): several times faster than torch.tensor(list) for the
    thousands of entries of a large decode step."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


def device_tensor(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype, device=device) without a host sync: from pinned memory on CUDA."""
    host = host_int64(values) if dtype == torch.int64 else torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def copy_to_buffer(buffer: torch.Tensor, values: list[int]) -> torch.Tensor:
    """Writes int64 values into buffer[:len(values)] (one copy, from pinned memory on CUDA); returns that view."""
    host = host_int64(values)
    if buffer.is_cuda:
        host = host.pin_memory()
    view = buffer[: host.numel()]
    view.copy_(host, non_blocking=True)
    return view


def copy_to_host(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A host copy of a device tensor, queued without waiting, and the event recorded after it (None off CUDA, where
    the tensor itself is returned): read the copy once the event has completed."""
    if not tensor.is_cuda:
        return tensor, None
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready
