"""Lazy reading of Hugging Face checkpoint folders (config.json + safetensors).

Dimension letters: E logical experts of a MoE layer, H hidden size, I one expert's
intermediate size, N experts read at once.

A folder holds ``config.json`` and either ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. Files are opened with ``safetensors.safe_open``, which parses
and checks the header and reads nothing else; a tensor's bytes are read when asked for, through
``get_slice`` (only one row of dim 0, for one expert of a fused expert tensor). ``bytes_read`` /
``tensors_read`` count what was read, so that an expert worker can be shown to load its own
experts and nothing else.

Tensor names passed to the reader are those of the text model (``model.layers.0...``,
``lm_head.weight``); the ``language_model.`` prefix of multimodal Llama 4 checkpoints is added
by the reader. Vision (``vision_model.*``, ``multi_modal_projector.*``) and ERNIE's
multi-token-prediction (``mtp*``) tensors are never read and are left out of :meth:`names`.

Routed experts come back in the canonical layout of ``moe.py`` whatever the file holds:
``gate_up [H, 2I]`` (gate first) and ``down [I, H]`` (and ``gate_up_bias [2I]``, ``down_bias
[H]`` for families with expert biases). Two on-disk layouts are read, under the family's
experts prefix (``moeserve.models.families.Names``):

- fused (Llama 4, GPT-OSS as published): ``experts.gate_up_proj [E, H, 2I]``,
  ``experts.down_proj [E, I, H]`` (GPT-OSS: gate and up columns interleaved, and
  ``gate_up_proj_bias [E, 2I]``, ``down_proj_bias [E, H]``);
- per expert, nn.Linear style (ERNIE, Qwen3-MoE, Mixtral; quantized Llama 4):
  ``experts.{e}.{gate}.weight [I, H]``, ``experts.{e}.{up}.weight [I, H]``,
  ``experts.{e}.{down}.weight [H, I]`` (Mixtral's w1, w3, w2).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open

from moeserve.models import families
from moeserve.models import quant as Q
from moeserve.models.config import CheckpointError, ModelConfig, load_config, with_quantization
from moeserve.models.moe import ExpertQuant, ExpertSpec

# safetensors dtype names -> torch dtypes, for stored_dtype (safetensors' own table is private).
ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
MAX_HEADER_BYTES = 100_000_000  # safetensors refuses longer headers; also bounds what an error message reads
SKIPPED_PREFIXES = ("vision_model.", "multi_modal_projector.")
SKIPPED_COMPONENT = "mtp"  # ERNIE's multi-token-prediction tensors: model.mtp_block.*, model.mtp_emb_norm.*, ...


class TensorSlice(Protocol):
    """What the reader uses of a safetensors slice (``safe_open(...).get_slice(name)``): nothing
    is read until it is indexed."""

    def get_shape(self) -> list[int]: ...

    def get_dtype(self) -> str: ...  # a key of ST_DTYPES

    def __getitem__(self, index: Any) -> torch.Tensor: ...


def expert_spec(cfg: ModelConfig, dtype: torch.dtype) -> ExpertSpec:
    """The routed experts' spec for compute dtype ``dtype`` (FP8 weights when quantized)."""
    quant = None
    if families.experts_quantized(cfg):
        assert cfg.quantization is not None
        if cfg.expert_bias:
            raise CheckpointError(
                f"{cfg.model_type}: FP8 routed experts with biases are not served (the {cfg.family} experts have "
                f"biases); serve the checkpoint in bf16, without --quantization fp8"
            )
        quant = ExpertQuant.from_scheme(cfg.quantization, cfg.hidden_size, cfg.moe_intermediate_size, dtype)
    return ExpertSpec(
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        cfg.expert_activation,
        cfg.expert_bias,
        dtype,
        quant,
        cfg.swiglu_alpha,
        cfg.swiglu_limit,
    )


@dataclass(frozen=True)
class SafetensorsFile:
    """One open ``.safetensors`` file: its ``safe_open`` handle and the names of its tensors.

    safetensors reads from a memory map of the file, not through a shared file position, so
    threads may read through one handle at once.
    """

    path: Path
    handle: safe_open
    names: frozenset[str]

    @classmethod
    def open(cls, path: Path) -> SafetensorsFile:
        try:
            handle = safe_open(path, framework="pt")
        except OSError as e:
            raise CheckpointError(f"{path}: cannot open ({e.strerror or e})") from None
        except SafetensorError as e:
            raise corrupt_file_error(path, e) from None
        return cls(path, handle, frozenset(handle.keys()))

    def close(self) -> None:
        self.handle.__exit__(None, None, None)  # safe_open has no close(); leaving its context closes it


def corrupt_file_error(path: Path, err: SafetensorError) -> CheckpointError:
    """Say what is wrong with a file that ``safe_open`` refused, in the terms of its layout.

    Layout: 8-byte little-endian header length n, n bytes of JSON header ``{name: {dtype,
    shape, data_offsets}}``, then the data section. safetensors names the check that failed,
    but not the sizes involved and not in the same words across its versions, so the length
    prefix and the JSON are looked at again here, on this error path only.
    """
    size = path.stat().st_size
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if size < 8:
            detail = f"file has {size} bytes, fewer than the 8-byte header length"
        elif n > size - 8:
            detail = f"header length {n} does not fit a file of {size} bytes"
        elif n > MAX_HEADER_BYTES:
            detail = f"header length {n} is over safetensors' limit of {MAX_HEADER_BYTES} bytes"
        else:
            try:
                json.loads(fh.read(n))
                detail = (
                    f"the tensors' dtype, shape and data_offsets do not hold them in a data section "
                    f"of {size - 8 - n} bytes"
                )
            except ValueError:
                detail = "header is not valid JSON"
    return CheckpointError(f"{path}: corrupt safetensors header: {detail} (safetensors: {err})")


def _no_fp8_cast(path: Path, name: str, stored: torch.dtype | None, dtype: torch.dtype | None) -> None:
    """A read of FP8 codes into another dtype (a cast without the scales: what served FP8
    checkpoints silently wrong) is refused by name."""
    if stored in (Q.FP8, torch.float8_e5m2) and dtype is not None and dtype != stored:
        raise CheckpointError(
            f"{path}: tensor '{name}' is stored in {stored}; it is read as FP8 codes with its scales "
            f"(config.json's quantization_config), never cast to {dtype}"
        )


def _owned(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` in ``dtype`` (default: its own), always in memory of its own.

    safetensors may return a view of its private memory map of the file (0.8 does): such a
    tensor would share memory with every later read of the same bytes, and could change or
    fault (SIGBUS) once the file is rewritten or truncated on disk.
    """
    return t.to(dtype or t.dtype, copy=True)


class CheckpointReader:
    """A checkpoint folder, opened lazily: config parsed, safetensors headers parsed, no weights read.

    ``bytes_read`` counts tensor-data bytes read from the files (shape times dtype size of each
    tensor or slice asked of safetensors) and ``tensors_read`` the reads (one per tensor, or per
    expert slice of a fused tensor); headers are not counted.
    """

    def __init__(self, path: str | Path, quantization: str | None = None):
        self.path = Path(path)
        self.config: ModelConfig = with_quantization(load_config(self.path), quantization)
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
            self._where = dict.fromkeys(self._file(single.name).names, single.name)
        else:
            raise CheckpointError(f"{self.path}: no model.safetensors or model.safetensors.index.json in the folder")
        if "model.embed_tokens.weight" in self._where:
            self.prefix = ""
        elif "language_model.model.embed_tokens.weight" in self._where:
            self.prefix = "language_model."
        else:
            raise CheckpointError(
                f"{self._source}: tensor 'model.embed_tokens.weight' is missing "
                "(also looked for 'language_model.model.embed_tokens.weight')"
            )

    # -- files ---------------------------------------------------------------------------------

    def _read_index(self, index: Path) -> dict[str, str]:
        try:
            raw = json.loads(index.read_text())
            wmap = raw["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"{index}: not a safetensors index (need a JSON object with 'weight_map'): {e}"
            ) from None
        if not isinstance(wmap, dict) or not all(isinstance(v, str) and "/" not in v for v in wmap.values()):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard file names in this folder")
        return dict(wmap)

    def _file(self, fname: str) -> SafetensorsFile:
        f = self._files.get(fname)
        if f is None:
            p = self.path / fname
            if not p.is_file():
                raise CheckpointError(f"{self._source}: lists shard '{fname}', which does not exist in {self.path}")
            # Two threads opening the same shard at once both get the handle stored first.
            f = self._files.setdefault(fname, SafetensorsFile.open(p))
        return f

    def _slice(self, name: str) -> tuple[SafetensorsFile, str, TensorSlice]:
        """The file holding ``name``, its full name there, and its safetensors slice (nothing read yet)."""
        full = self.prefix + name
        fname = self._where.get(full)
        if fname is None:
            raise CheckpointError(f"{self._source}: tensor '{full}' is missing")
        f = self._file(fname)
        if full not in f.names:
            raise CheckpointError(f"{f.path}: tensor '{full}' is missing (the index places it in this file)")
        return f, full, f.handle.get_slice(full)

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
            name = full[len(self.prefix) :]
            if name.startswith(SKIPPED_PREFIXES) or any(c.startswith(SKIPPED_COMPONENT) for c in name.split(".")):
                continue
            out.append(name)
        return sorted(out)

    def has(self, name: str) -> bool:
        return self.prefix + name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name)[2].get_shape())

    def stored_dtype(self, name: str) -> torch.dtype:
        f, full, sl = self._slice(name)
        st = sl.get_dtype()
        if st not in ST_DTYPES:
            raise CheckpointError(f"{f.path}: tensor '{full}' has dtype {st}; the reader knows {sorted(ST_DTYPES)}")
        return ST_DTYPES[st]

    def read(self, name: str, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Read one whole tensor, checking its shape when ``shape`` is given; cast to ``dtype``.
        FP8 codes are never cast: they mean nothing without their scales (``quant.read_weight``)."""
        f, full, sl = self._slice(name)
        if shape is not None:
            self._check_shape(f, full, sl.get_shape(), shape)
        _no_fp8_cast(f.path, full, ST_DTYPES.get(sl.get_dtype()), dtype)
        t = f.handle.get_tensor(full)
        self._count(t)
        return _owned(t, dtype)

    def read_rows(self, name: str, start: int, count: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Read rows ``start .. start+count-1`` of dim 0 of a tensor: [count, *shape[1:]]."""
        f, full, sl = self._slice(name)
        shape = tuple(sl.get_shape())
        if not shape or not 0 <= start <= start + count <= shape[0]:
            raise CheckpointError(
                f"{f.path}: tensor '{full}' of shape {shape} has no rows {start}..{start + count - 1}"
            )
        _no_fp8_cast(f.path, full, ST_DTYPES.get(sl.get_dtype()), dtype)
        t = sl[start : start + count]
        self._count(t)
        return _owned(t, dtype)

    def _count(self, t: torch.Tensor) -> None:
        self.bytes_read += t.numel() * t.element_size()
        self.tensors_read += 1

    @staticmethod
    def _check_shape(f: SafetensorsFile, full: str, found: Sequence[int], expected: Sequence[int]) -> None:
        if tuple(found) != tuple(expected):
            raise CheckpointError(f"{f.path}: tensor '{full}' has shape {list(found)}, expected {list(expected)}")

    def check_shape(self, name: str, expected: tuple[int, ...]) -> None:
        """Raise CheckpointError naming the file and tensor unless ``name`` has shape ``expected``."""
        f, full, sl = self._slice(name)
        self._check_shape(f, full, sl.get_shape(), expected)

    # -- routed experts ------------------------------------------------------------------------

    def _experts_prefix(self, moe_layer: int) -> str:
        cfg = self.config
        if not 0 <= moe_layer < cfg.num_moe_layers:
            raise ValueError(
                f"MoE layer index {moe_layer} out of range 0..{cfg.num_moe_layers - 1} "
                f"(the ordinal among MoE layers, not the decoder-layer index)"
            )
        return families.names(cfg).experts(cfg.moe_layer_ids[moe_layer])

    def expert_layout(self, moe_layer: int) -> str:
        """ "fused" (experts.gate_up_proj / down_proj) or "per_expert" (experts.{e}.*_proj.weight)."""
        return "fused" if self.has(self._experts_prefix(moe_layer) + "gate_up_proj") else "per_expert"

    def expert_spec(self, dtype: torch.dtype | None = None) -> ExpertSpec:
        """The routed experts' spec; the compute dtype defaults to the stored dtype of MoE layer
        0's experts (the checkpoint's dtype when they are FP8)."""
        cfg = self.config
        if dtype is None and cfg.num_moe_layers:
            p = self._experts_prefix(0)
            gate = families.names(cfg).expert_linears[0]
            dtype = self.stored_dtype(p + ("gate_up_proj" if self.expert_layout(0) == "fused" else f"0.{gate}.weight"))
            if dtype in (Q.FP8, torch.float8_e5m2):
                dtype = cfg.dtype
        return expert_spec(cfg, dtype or cfg.dtype)

    def read_expert(self, moe_layer: int, expert: int, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """One logical expert of one MoE layer, canonical (``read_expert``): exactly its bytes."""
        return read_expert(self, moe_layer, expert, dtype)

    def read_experts(self, moe_layer: int, ids, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Several logical experts stacked in ``ids`` order (``read_experts``)."""
        return read_experts(self, moe_layer, ids, dtype)


def check_quantized_tensors(path: str | Path, cfg: ModelConfig) -> None:
    """Refuse, from the files' headers alone, a checkpoint that stores FP8 tensors without a
    quantization_config (``cfg``: its config, with any --quantization applied): their codes
    would be read without their scales."""
    if cfg.quantization is not None and cfg.quantization.format != "online":
        return
    with CheckpointReader(path) as reader:
        for name in reader.names():
            stored = reader.stored_dtype(name)
            if stored in (Q.FP8, torch.float8_e5m2):
                raise CheckpointError(
                    f"{reader.path}: tensor '{name}' is stored in {stored} but config.json declares no "
                    f"quantization_config: moeserve does not guess its scales; {Q.SUPPORTED}"
                )


# -- routed experts, for either reader (this one, and ``dummy.DummyReader``) ----------------------


def read_expert(reader, moe_layer: int, expert: int, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """One logical expert of one MoE layer, canonical: gate_up [H, 2I], down [I, H] (and
    gate_up_bias [2I], down_bias [H] with expert biases); for FP8 experts the codes and their
    scales, gate_up_scale [Kb, 2 Nb] (gate's blocks, then up's) and down_scale
    (``moe.ExpertSpec``), whatever ``dtype`` says.

    Reads exactly that expert's bytes (one row of each fused tensor, or its per-expert tensors
    and their scales). FP8 tensors where the model's quantization keeps the experts
    unquantized, or unquantized ones where it declares them FP8, are refused by name.
    """
    cfg = reader.config
    h, i, n_exp = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    names = families.names(cfg)
    prefix = reader._experts_prefix(moe_layer)
    if not 0 <= expert < n_exp:
        raise ValueError(f"logical expert id {expert} out of range 0..{n_exp - 1}")
    quantized = families.experts_quantized(cfg)
    if reader.expert_layout(moe_layer) == "fused":
        return _read_fused(reader, prefix, expert, dtype, quantized)
    g_name, u_name, d_name = names.expert_linears
    p = f"{prefix}{expert}."
    if not reader.has(f"{p}{g_name}.weight"):
        raise CheckpointError(
            f"{reader._source}: tensor '{reader.prefix}{prefix}gate_up_proj' is missing, and so is "
            f"the per-expert '{reader.prefix}{p}{g_name}.weight' (routed experts of MoE layer "
            f"{moe_layer} = decoder layer {cfg.moe_layer_ids[moe_layer]})"
        )
    if reader.stored_dtype(f"{p}{g_name}.weight") == Q.FP8:
        scheme = cfg.quantization
        if scheme is None or scheme.format == "online":  # the refusal a linear layer's read gives
            Q.read_weight(reader, f"{p}{g_name}", (i, h), torch.float32, "cpu")
        if not quantized:
            raise CheckpointError(
                f"{reader._source}: tensor '{p}{g_name}.weight' is FP8, but the model's quantization keeps "
                f"its routed experts unquantized"
            )
        g, u, d = (
            Q.read_weight(reader, p + name, shape, torch.float32, "cpu")
            for name, shape in ((g_name, (i, h)), (u_name, (i, h)), (d_name, (h, i)))
        )
        assert isinstance(g, Q.QuantLinear) and isinstance(u, Q.QuantLinear) and isinstance(d, Q.QuantLinear)
        return {
            "gate_up": torch.cat([g.codes.t(), u.codes.t()], dim=1).contiguous(),  # [H, 2I]
            "gate_up_scale": torch.cat([g.scale.t(), u.scale.t()], dim=1).contiguous(),  # [Kb, 2 Nb]
            "down": d.codes.t().contiguous(),  # [I, H]
            "down_scale": d.scale.t().contiguous(),
        }
    _check_declared(reader, f"{p}{g_name}.weight", quantized)
    gate = reader.read(f"{p}{g_name}.weight", dtype, shape=(i, h))  # [I, H]
    up = reader.read(f"{p}{u_name}.weight", dtype, shape=(i, h))  # [I, H]
    down = reader.read(f"{p}{d_name}.weight", dtype, shape=(h, i))  # [H, I]
    out = {"gate_up": torch.cat([gate.t(), up.t()], dim=1).contiguous(), "down": down.t().contiguous()}
    if cfg.expert_bias:
        gb, ub = (reader.read(f"{p}{n}.bias", dtype, shape=(i,)) for n in (g_name, u_name))
        out["gate_up_bias"] = torch.cat([gb, ub])  # [2I]
        out["down_bias"] = reader.read(f"{p}{d_name}.bias", dtype, shape=(h,))  # [H]
    return out


def _read_fused(
    reader, prefix: str, expert: int, dtype: torch.dtype | None, quantized: bool
) -> dict[str, torch.Tensor]:
    """One expert's rows of the fused tensors [E, H, 2I] and [E, I, H] (x @ W), de-interleaved
    when the family alternates gate and up columns (GPT-OSS), with their bias rows."""
    cfg = reader.config
    h, i, n_exp = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    reader.check_shape(prefix + "gate_up_proj", (n_exp, h, 2 * i))
    reader.check_shape(prefix + "down_proj", (n_exp, i, h))
    if reader.stored_dtype(prefix + "gate_up_proj") in (Q.FP8, torch.float8_e5m2):
        raise CheckpointError(
            f"{reader._source}: fused FP8 experts ('{prefix}gate_up_proj') are not a published layout: FP8 "
            f"checkpoints store one Linear per expert (experts.{{e}}.gate_proj.weight with its weight_scale)"
        )
    _check_declared(reader, prefix + "gate_up_proj", quantized)
    gate_up = reader.read_rows(prefix + "gate_up_proj", expert, 1, dtype)[0]  # [H, 2I]
    out = {"down": reader.read_rows(prefix + "down_proj", expert, 1, dtype)[0]}  # [I, H]
    bias = None
    if cfg.expert_bias:
        reader.check_shape(prefix + "gate_up_proj_bias", (n_exp, 2 * i))
        reader.check_shape(prefix + "down_proj_bias", (n_exp, h))
        bias = reader.read_rows(prefix + "gate_up_proj_bias", expert, 1, dtype)[0]  # [2I]
        out["down_bias"] = reader.read_rows(prefix + "down_proj_bias", expert, 1, dtype)[0]  # [H]
    if families.names(cfg).interleaved:  # columns g0, u0, g1, u1, ...: gate first, then up
        gate_up = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)
        if bias is not None:
            bias = torch.cat([bias[0::2], bias[1::2]])
    out["gate_up"] = gate_up.contiguous()
    if bias is not None:
        out["gate_up_bias"] = bias.contiguous()
    return {k: out[k] for k in ("gate_up", "down", "gate_up_bias", "down_bias") if k in out}


def _check_declared(reader, name: str, quantized: bool) -> None:
    """Unquantized experts where the checkpoint's own quantization_config declares FP8 ones
    (as opposed to --quantization fp8, which quantizes them at load) are refused."""
    scheme = reader.config.quantization
    if quantized and scheme is not None and scheme.format != "online":
        raise CheckpointError(
            f"{reader._source}: tensor '{name}' is {reader.stored_dtype(name)}, but quantization_config "
            f"({scheme.name}) declares FP8 routed experts"
        )


def read_experts(reader, moe_layer: int, ids, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Several logical experts stacked in ``ids`` order: gate_up [N, H, 2I], down [N, I, H] (and
    the scales of FP8 experts). ``ids`` may repeat (a logical expert can fill several slots);
    each distinct expert is read once."""
    ids = [int(e) for e in ids]
    if not ids:
        spec = reader.expert_spec(dtype)
        return {k: torch.empty((0, *s), dtype=spec.tensor_dtypes[k]) for k, s in spec.shapes.items()}
    cache = {e: read_expert(reader, moe_layer, e, dtype) for e in dict.fromkeys(ids)}
    return {k: torch.stack([cache[e][k] for e in ids]) for k in cache[ids[0]]}
