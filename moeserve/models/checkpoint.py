"""Lazy reading of Hugging Face checkpoint folders (config.json + safetensors).

Dimension letters: E logical experts of a MoE layer, H hidden size, I one expert's
intermediate size, N experts read at once.

A folder holds ``config.json`` and either ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. Only the headers are parsed up front; a tensor's bytes are
read when asked for, with a seek and a read of exactly its byte range (or of one row of dim 0,
for one expert of a fused expert tensor). ``bytes_read`` / ``tensors_read`` count what was read,
so that an expert worker can be shown to load its own experts and nothing else.

Tensor names passed to the reader are those of the text model (``model.layers.0...``,
``lm_head.weight``); the ``language_model.`` prefix of multimodal Llama 4 checkpoints is added
by the reader. Vision (``vision_model.*``, ``multi_modal_projector.*``) and ERNIE's
multi-token-prediction (``mtp*``) tensors are never read and are left out of :meth:`names`.

Routed experts come back in the canonical layout of ``moe.py`` whatever the file holds:
``gate_up [H, 2I]`` (gate first) and ``down [I, H]``. Two on-disk layouts are read:

- fused (Llama 4 as published): ``experts.gate_up_proj [E, H, 2I]``, ``experts.down_proj [E, I, H]``;
- per expert, nn.Linear style (ERNIE; quantized Llama 4): ``experts.{e}.gate_proj.weight [I, H]``,
  ``experts.{e}.up_proj.weight [I, H]``, ``experts.{e}.down_proj.weight [H, I]``.
"""
from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from moeserve.models.config import CheckpointError, ModelConfig, load_config
from moeserve.models.moe import ExpertSpec

# safetensors dtype names -> torch dtypes (all that torch can hold; headers with others are rejected).
ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
MAX_HEADER_BYTES = 100 * 1024 * 1024
SKIPPED_PREFIXES = ("vision_model.", "multi_modal_projector.")
SKIPPED_COMPONENT = "mtp"    # ERNIE's multi-token-prediction tensors: model.mtp_block.*, model.mtp_emb_norm.*, ...
# Where each family keeps the routed experts of decoder layer i.
EXPERTS_PREFIX = {"llama4": "model.layers.{}.feed_forward.experts.", "ernie45": "model.layers.{}.mlp.experts."}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: dtype, shape and its byte range in the data section."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


class SafetensorsFile:
    """One ``.safetensors`` file: the header parsed at open, tensor bytes read on demand.

    Layout: 8-byte little-endian header length n, n bytes of JSON ``{name: {dtype, shape,
    data_offsets: [begin, end]}, "__metadata__": {...}}``, then the data section; offsets are
    relative to the start of the data section.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._fh = open(self.path, "rb")
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot open ({e.strerror})") from None
        self._lock = threading.Lock()
        self.entries = self._parse_header()

    def _corrupt(self, detail: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: corrupt safetensors header: {detail}")

    def _parse_header(self) -> dict[str, TensorEntry]:
        size = self.path.stat().st_size
        head = self._fh.read(8)
        if len(head) < 8:
            raise self._corrupt(f"file has {size} bytes, fewer than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > size - 8 or n > MAX_HEADER_BYTES:
            raise self._corrupt(f"header length {n} does not fit a file of {size} bytes")
        try:
            header = json.loads(self._fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._corrupt(f"header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise self._corrupt("header is not a JSON object")
        self.data_start = 8 + n
        data_len = size - self.data_start
        entries = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = ST_DTYPES[info["dtype"]]
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise self._corrupt(f"tensor '{name}' has a malformed entry {info!r} "
                                    f"(need dtype in {sorted(ST_DTYPES)}, shape, data_offsets)") from None
            nbytes = math.prod(shape) * dtype.itemsize
            if min(shape, default=0) < 0 or not 0 <= begin <= end <= data_len or end - begin != nbytes:
                raise self._corrupt(f"tensor '{name}' has data_offsets {[begin, end]} that do not hold "
                                    f"{shape} {info['dtype']} inside a data section of {data_len} bytes")
            entries[name] = TensorEntry(dtype, shape, begin, end)
        return entries

    def read(self, name: str, row_start: int = 0, num_rows: int | None = None) -> torch.Tensor:
        """Read a tensor, or rows ``row_start .. row_start+num_rows-1`` of its dim 0, from disk.

        Returns a tensor in the stored dtype, [num_rows, *shape[1:]] when rows are asked for.
        """
        e = self.entries[name]
        shape = e.shape
        offset, nbytes = e.begin, e.end - e.begin
        if num_rows is not None:
            row_bytes = math.prod(shape[1:]) * e.dtype.itemsize
            offset += row_start * row_bytes
            nbytes = num_rows * row_bytes
            shape = (num_rows, *shape[1:])
        buf = torch.empty(nbytes, dtype=torch.uint8)
        with self._lock:
            self._fh.seek(self.data_start + offset)
            got = self._fh.readinto(memoryview(buf.numpy())) if nbytes else 0
        if got != nbytes:
            raise CheckpointError(f"{self.path}: tensor '{name}' is truncated ({got} of {nbytes} bytes)")
        return buf.view(e.dtype).view(shape)

    def close(self) -> None:
        self._fh.close()


class CheckpointReader:
    """A checkpoint folder, opened lazily: config parsed, safetensors headers parsed, no weights read.

    ``bytes_read`` counts tensor-data bytes read from disk and ``tensors_read`` the reads (one
    per tensor, or per expert slice of a fused tensor); headers are not counted.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.config: ModelConfig = load_config(self.path)
        self.bytes_read = 0
        self.tensors_read = 0
        self._files: dict[str, SafetensorsFile] = {}
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.is_file():
            self._source = index
            self._where = self._read_index(index)
        elif single.is_file():
            self._source = single
            self._where = {name: single.name for name in self._file(single.name).entries}
        else:
            raise CheckpointError(f"{self.path}: no model.safetensors or model.safetensors.index.json in the folder")
        if "model.embed_tokens.weight" in self._where:
            self.prefix = ""
        elif "language_model.model.embed_tokens.weight" in self._where:
            self.prefix = "language_model."
        else:
            raise CheckpointError(f"{self._source}: tensor 'model.embed_tokens.weight' is missing "
                                  "(also looked for 'language_model.model.embed_tokens.weight')")

    # -- files ---------------------------------------------------------------------------------

    def _read_index(self, index: Path) -> dict[str, str]:
        try:
            raw = json.loads(index.read_text())
            wmap = raw["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index (need a JSON object with 'weight_map'): {e}") from None
        if not isinstance(wmap, dict) or not all(isinstance(v, str) and "/" not in v for v in wmap.values()):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard file names in this folder")
        return dict(wmap)

    def _file(self, fname: str) -> SafetensorsFile:
        f = self._files.get(fname)
        if f is None:
            p = self.path / fname
            if not p.is_file():
                raise CheckpointError(f"{self._source}: lists shard '{fname}', which does not exist in {self.path}")
            f = self._files[fname] = SafetensorsFile(p)
        return f

    def _entry(self, name: str) -> tuple[SafetensorsFile, str, TensorEntry]:
        full = self.prefix + name
        fname = self._where.get(full)
        if fname is None:
            raise CheckpointError(f"{self._source}: tensor '{full}' is missing")
        f = self._file(fname)
        if full not in f.entries:
            raise CheckpointError(f"{f.path}: tensor '{full}' is missing (the index places it in this file)")
        return f, full, f.entries[full]

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- tensors -------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Text-model tensor names (prefix stripped; vision and mtp tensors left out), sorted."""
        out = []
        for full in self._where:
            if not full.startswith(self.prefix):
                continue
            name = full[len(self.prefix):]
            if name.startswith(SKIPPED_PREFIXES) or any(c.startswith(SKIPPED_COMPONENT) for c in name.split(".")):
                continue
            out.append(name)
        return sorted(out)

    def has(self, name: str) -> bool:
        return self.prefix + name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[2].shape

    def stored_dtype(self, name: str) -> torch.dtype:
        return self._entry(name)[2].dtype

    def read(self, name: str, dtype: torch.dtype | None = None,
             shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Read one whole tensor, checking its shape when ``shape`` is given; cast to ``dtype``."""
        f, full, e = self._entry(name)
        if shape is not None:
            self._check_shape(f, full, e.shape, shape)
        t = f.read(full)
        self._count(t)
        return t if dtype is None else t.to(dtype)

    def read_rows(self, name: str, start: int, count: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Read rows ``start .. start+count-1`` of dim 0 of a tensor: [count, *shape[1:]]."""
        f, full, e = self._entry(name)
        if not e.shape or not 0 <= start <= start + count <= e.shape[0]:
            raise CheckpointError(f"{f.path}: tensor '{full}' of shape {e.shape} has no rows {start}..{start + count - 1}")
        t = f.read(full, start, count)
        self._count(t)
        return t if dtype is None else t.to(dtype)

    def _count(self, t: torch.Tensor) -> None:
        self.bytes_read += t.numel() * t.element_size()
        self.tensors_read += 1

    @staticmethod
    def _check_shape(f: SafetensorsFile, full: str, found: tuple[int, ...], expected: tuple[int, ...]) -> None:
        if tuple(found) != tuple(expected):
            raise CheckpointError(f"{f.path}: tensor '{full}' has shape {list(found)}, expected {list(expected)}")

    def check_shape(self, name: str, expected: tuple[int, ...]) -> None:
        """Raise CheckpointError naming the file and tensor unless ``name`` has shape ``expected``."""
        f, full, e = self._entry(name)
        self._check_shape(f, full, e.shape, expected)

    # -- routed experts ------------------------------------------------------------------------

    def _experts_prefix(self, moe_layer: int) -> str:
        cfg = self.config
        if not 0 <= moe_layer < cfg.num_moe_layers:
            raise ValueError(f"MoE layer index {moe_layer} out of range 0..{cfg.num_moe_layers - 1} "
                             f"(the ordinal among MoE layers, not the decoder-layer index)")
        return EXPERTS_PREFIX[self.config.family].format(cfg.moe_layer_ids[moe_layer])

    def expert_layout(self, moe_layer: int) -> str:
        """"fused" (experts.gate_up_proj / down_proj) or "per_expert" (experts.{e}.*_proj.weight)."""
        return "fused" if self.has(self._experts_prefix(moe_layer) + "gate_up_proj") else "per_expert"

    def expert_spec(self, dtype: torch.dtype | None = None) -> ExpertSpec:
        """The routed experts' spec; dtype defaults to the stored dtype of MoE layer 0's experts."""
        cfg = self.config
        if dtype is None and cfg.num_moe_layers:
            p = self._experts_prefix(0)
            dtype = self.stored_dtype(p + ("gate_up_proj" if self.expert_layout(0) == "fused" else "0.gate_proj.weight"))
        return ExpertSpec(cfg.hidden_size, cfg.moe_intermediate_size, "silu", False, dtype or cfg.dtype)

    def read_expert(self, moe_layer: int, expert: int, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """One logical expert of one MoE layer, canonical: gate_up [H, 2I], down [I, H].

        Reads exactly that expert's bytes (one row of each fused tensor, or its three
        per-expert tensors).
        """
        cfg = self.config
        h, i, n_exp = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        prefix = self._experts_prefix(moe_layer)
        if not 0 <= expert < n_exp:
            raise ValueError(f"logical expert id {expert} out of range 0..{n_exp - 1}")
        if self.expert_layout(moe_layer) == "fused":
            self.check_shape(prefix + "gate_up_proj", (n_exp, h, 2 * i))
            self.check_shape(prefix + "down_proj", (n_exp, i, h))
            gate_up = self.read_rows(prefix + "gate_up_proj", expert, 1, dtype)[0]     # [H, 2I]
            down = self.read_rows(prefix + "down_proj", expert, 1, dtype)[0]           # [I, H]
            return {"gate_up": gate_up, "down": down}
        p = f"{prefix}{expert}."
        if not self.has(p + "gate_proj.weight"):
            raise CheckpointError(f"{self._source}: tensor '{self.prefix}{prefix}gate_up_proj' is missing, and so is "
                                  f"the per-expert '{self.prefix}{p}gate_proj.weight' (routed experts of MoE layer "
                                  f"{moe_layer} = decoder layer {cfg.moe_layer_ids[moe_layer]})")
        gate = self.read(p + "gate_proj.weight", dtype, shape=(i, h))                   # [I, H]
        up = self.read(p + "up_proj.weight", dtype, shape=(i, h))                       # [I, H]
        down = self.read(p + "down_proj.weight", dtype, shape=(h, i))                   # [H, I]
        return {"gate_up": torch.cat([gate.t(), up.t()], dim=1).contiguous(), "down": down.t().contiguous()}

    def read_experts(self, moe_layer: int, ids, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Several logical experts stacked in ``ids`` order: gate_up [N, H, 2I], down [N, I, H].

        ``ids`` may repeat (a logical expert can fill several slots); each distinct expert is
        read from disk once.
        """
        ids = [int(e) for e in ids]
        cache = {e: self.read_expert(moe_layer, e, dtype) for e in dict.fromkeys(ids)}
        if not ids:
            spec = self.expert_spec(dtype)
            return {k: torch.empty((0, *s), dtype=spec.dtype) for k, s in spec.shapes.items()}
        return {k: torch.stack([cache[e][k] for e in ids]) for k in ("gate_up", "down")}
