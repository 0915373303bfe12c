"""Host-side helpers shared by the CUDA-kernel backends: device facts, the fp16 (hi, lo)
split and padded weight pairs, uint8 masks and per-sequence key extents, the per-shape chunk
plan and the chunk loop."""
from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path
from typing import Callable

import torch

from .memory import sequences_per_chunk


MAX_GRID_X = 2 ** 31 - 1  # CUDA's largest grid dimension x
MAX_GRID_Y = 65535  # and y (z too)


@functools.cache
def multiprocessor_count(device: torch.device) -> int:
    """The device's multiprocessor count (1 on a CPU)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def max_shared_memory_per_block(device: torch.device) -> int | None:
    """Dynamic shared memory one block may opt in to, in bytes (None if PyTorch cannot tell)."""
    if device.type != "cuda":
        return None
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin",
                   None)


def shared_memory_per_multiprocessor(device: torch.device) -> int | None:
    """Shared memory of one multiprocessor, in bytes (None if PyTorch cannot tell)."""
    if device.type != "cuda":
        return None
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_multiprocessor",
                   None)


def capability_shortfall(device: torch.device, minimum: tuple[int, int] = (8, 0)) -> str | None:
    """Why a CUDA device is below compute capability minimum, or None (also where no CUDA
    device is at hand: the device checks of the interface report that)."""
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < minimum:
            return (f"needs compute capability {minimum[0]}.{minimum[1]} or newer, not "
                    f"{major}.{minor}")
    return None


def device_arch(device: torch.device) -> str:
    """The compute capability of a CUDA device as digits, e.g. '90' for an H100/H200."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}{minor}"


def cuda_tool(name: str) -> str:
    """Path of a CUDA binary tool (cuobjdump, nvdisasm): the toolkit's on PATH, else the copy
    bundled with Triton, else the NVIDIA pip package's; the bare name if none is found."""
    found = shutil.which(name)
    if found:
        return found
    candidates = []
    try:
        import triton
        candidates.append(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)
    except ImportError:
        pass
    try:
        import nvidia
        candidates += [Path(p) / "cu13" / "bin" / name for p in nvidia.__path__]
    except ImportError:
        pass
    return next((str(c) for c in candidates if c.exists()), name)


def cubin_kernels(cubin) -> dict[str, dict]:
    """Per kernel symbol in a cubin: its parameter sizes in order and its required block size
    (EIATTR_REQNTID, None if unset), read with cuobjdump -elf."""
    text = subprocess.run([cuda_tool("cuobjdump"), "-elf", str(cubin)], check=True,
                          capture_output=True, text=True).stdout
    info = {}
    for section in re.split(r"\n(?=\.nv\.info\.)", text):
        head = re.match(r"\.nv\.info\.(\w+)", section)
        if not head:
            continue
        params = re.findall(r"Ordinal\s*:\s*(0x[0-9a-f]+)\s+Offset\s*:\s*0x[0-9a-f]+\s+"
                            r"Size\s*:\s*(0x[0-9a-f]+)", section)
        threads = re.search(r"EIATTR_REQNTID\s+Format:\s*\w+\s+Value:\s*(0x[0-9a-f]+)\s+"
                            r"(0x[0-9a-f]+)\s+(0x[0-9a-f]+)", section)
        info[head.group(1)] = {
            "params": [int(s, 16) for _, s in sorted(params, key=lambda p: int(p[0], 16))],
            "threads": [int(v, 16) for v in threads.groups()] if threads else None}
    return info


def split_fp16(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) fp16 tensors with hi + lo == t to about 22 bits."""
    hi = t.to(torch.float16)
    lo = (t - hi.to(t.dtype)).to(torch.float16)
    return hi.contiguous(), lo.contiguous()


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


def padded(n: int) -> int:
    """n rounded up to a multiple of 8 (fp16 rows of 16-byte multiples)."""
    return cdiv(n, 8) * 8


def weight_pair(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] as an (hi, lo) fp16 pair [N8, K8], both sizes rounded up to multiples of 8
    with zeros (the padded columns of a GEMM's output are then bias only)."""
    n, k = w.shape
    pair = []
    for part in split_fp16(w):
        store = torch.zeros(padded(n), padded(k), dtype=torch.float16, device=w.device)
        store[:n, :k] = part
        pair.append(store)
    return pair[0], pair[1]


def padded_vector(v: torch.Tensor) -> torch.Tensor:
    """v with zeros appended to a multiple of 8 elements."""
    out = torch.zeros(padded(v.shape[0]), dtype=v.dtype, device=v.device)
    out[:v.shape[0]] = v
    return out


def key_info(valid: torch.Tensor) -> torch.Tensor:
    """[B, 4] int32 per sequence of a [B, S] uint8 key mask: the end of its valid keys (last
    valid + 1, 0 if none), 1 where some key before that end is invalid (the kernel must then
    read the mask), and two zeros that keep each row 16 bytes long."""
    s = valid.shape[1]
    positions = torch.arange(1, s + 1, device=valid.device, dtype=torch.int32)
    end = (valid.to(torch.int32) * positions).amax(dim=1)
    holes = valid.sum(dim=1, dtype=torch.int32) != end
    zero = torch.zeros_like(end)
    return torch.stack([end, holes.to(torch.int32), zero, zero], dim=1).contiguous()


def float_rows(x2: torch.Tensor, out2: torch.Tensor,
               staging: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(source, target) rows for kernels that read and write fp32 rows at 16-byte aligned
    addresses: x2 and out2 where they are, else staging (x2 copied into it). Both may be
    staging: the source is read before the target is written. The caller copies a staged
    target into out2."""
    def usable(t):
        return t.dtype == torch.float32 and t.data_ptr() % 16 == 0
    src = x2
    if not usable(x2):
        staging.copy_(x2)
        src = staging
    return src, out2 if usable(out2) else staging


def mask_bytes(valid_token_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The bool [B, S] mask viewed as uint8 (no copy), or None."""
    return None if valid_token_mask is None else valid_token_mask.view(torch.uint8)


class ChunkPlan:
    """Sequences per chunk for each input [batch, seq_len], planned once per shape (never
    while a CUDA graph is being captured: the plan asks the device for free memory)."""

    def __init__(self, device: torch.device, per_sequence_bytes: Callable[[int], int],
                 fixed_bytes: int, max_sequences: int | None = None):
        self.device = device
        self.per_sequence_bytes = per_sequence_bytes  # seq_len -> workspace bytes
        self.fixed_bytes = fixed_bytes
        self.max_sequences = max_sequences
        self.chunks: dict[tuple[int, int], int] = {}

    def __call__(self, batch: int, seq_len: int, reserve_bytes: int = 0) -> int:
        """Sequences per chunk for a [batch, seq_len] input (at least 1); reserve_bytes: buffers
        not yet allocated when the plan is made (the output, when planned before a forward)."""
        if (batch, seq_len) not in self.chunks:
            chunk = sequences_per_chunk(self.per_sequence_bytes(seq_len),
                                        self.fixed_bytes + reserve_bytes, batch, self.device)
            if self.max_sequences is not None:
                chunk = min(chunk, self.max_sequences)
            self.chunks[(batch, seq_len)] = max(1, chunk)
        return self.chunks[(batch, seq_len)]

    def halve(self, batch: int, seq_len: int) -> None:
        """Halve the planned chunk of a [batch, seq_len] input (at least 1 sequence)."""
        self.chunks[(batch, seq_len)] = max(1, min(self(batch, seq_len), batch) // 2)


def run_in_chunks(x: torch.Tensor, out: torch.Tensor, chunks: ChunkPlan,
                  workspace: dict[str, tuple[int, torch.dtype]], run: Callable) -> None:
    """Allocate a workspace for chunks(batch, seq_len) sequences (name -> (columns per token,
    dtype)), then call run(b0, b1, x2, out2, work) for each chunk of sequences [b0, b1), with
    x2 and out2 the chunk's rows as [tokens, d_model] views and work sliced to its tokens."""
    b, s, d = x.shape
    work = allocate_workspace(chunks, b, s, workspace, x.device)
    chunk = chunks(b, s)
    for b0 in range(0, b, chunk):
        b1 = min(b, b0 + chunk)
        tokens = (b1 - b0) * s
        run(b0, b1, x[b0:b1].view(-1, d), out[b0:b1].view(-1, d),
            {k: v[:tokens] for k, v in work.items()})


def allocate_workspace(chunks: ChunkPlan, batch: int, seq_len: int,
                       workspace: dict[str, tuple[int, torch.dtype]],
                       device: torch.device) -> dict[str, torch.Tensor]:
    """The workspace buffers for the plan's chunk of a [batch, seq_len] input. Where they do
    not fit (the caching allocator's free blocks may be fragmented, or memory was taken since
    the plan), cached blocks are released, then the chunk is halved until they fit; the plan
    keeps the chunk that fitted. Never while a CUDA graph is being captured."""
    released = False
    while True:
        rows = min(chunks(batch, seq_len), batch) * seq_len
        try:
            return {name: torch.empty(rows, cols, device=device, dtype=dtype)
                    for name, (cols, dtype) in workspace.items()}
        except torch.OutOfMemoryError:
            if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
                raise
            if released and chunks(batch, seq_len) == 1:
                raise
        # Out of the handler, so the buffers allocated before the failure are freed.
        if not released:
            torch.cuda.empty_cache()
            released = True
        else:
            chunks.halve(batch, seq_len)


def forward_in_chunks(x: torch.Tensor, valid_token_mask: torch.Tensor | None,
                      out: torch.Tensor | None, chunks: ChunkPlan,
                      workspace: dict[str, tuple[int, torch.dtype]],
                      run: Callable) -> torch.Tensor:
    """A layer's forward over chunks of sequences: the mask as uint8 bytes and its per-sequence
    key extents (key_info) made once, then run(x2, (valid, info) or (None, None), out2,
    sequences, seq_len, work) per chunk; out (a new tensor when None) is returned."""
    b, s, _ = x.shape
    valid = mask_bytes(valid_token_mask)
    info = None if valid is None else key_info(valid)
    out = torch.empty_like(x) if out is None else out

    def run_chunk(b0, b1, x2, out2, work):
        masks = (None, None) if valid is None else (valid[b0:b1], info[b0:b1])
        run(x2, masks, out2, b1 - b0, s, work)
    run_in_chunks(x, out, chunks, workspace, run_chunk)
    return out
