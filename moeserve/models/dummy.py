"""``--load-format dummy`` (vLLM's name): seeded random weights made on the device, no checkpoint files.

:class:`DummyReader` is a drop-in for :class:`~moeserve.models.checkpoint.CheckpointReader`
wherever weights are read (``load_model`` and the families' loaders, ``ExpertStore.from_checkpoint``,
migrations' digests in tests): the same methods, the same names, shapes and canonical expert
layout, but every tensor is made directly on the reader's device from ``config.json`` alone
(and ``generation_config.json`` when present). Only ``config.json`` must exist in the folder.

Values are uniform in [-1e-3, 1e-3] (vLLM's ``initialize_dummy_weights``); RMSNorm weights are
ones, so activations keep a sensible scale through the layers. Each tensor comes from its own
generator, seeded by ``(seed, tensor name)`` (and, for a fused expert tensor, the expert's
row), so:

- every rank that asks for a tensor or an expert gets identical bytes, whatever else it read
  before and in whichever order; replicas of an expert on different workers are bit-identical,
  and a migrated expert equals the one the destination would have read itself;
- values are made in float32 and cast to the requested dtype, so a tensor read in two dtypes
  is the same numbers rounded twice.

The bytes depend on the device *type* (torch's CPU and CUDA generators differ) and, on CUDA, on
the GPU model (the kernel's grid follows the SM count); ranks of one cluster on one kind of
GPU agree. ``bytes_read`` / ``tensors_read`` count what was made, as the checkpoint reader
counts what it read.

Names are those a checkpoint of the config would hold, in the layout the families publish:
Llama 4 with fused experts (``experts.gate_up_proj [E, H, 2I]``, ``experts.down_proj [E, I, H]``),
ERNIE with per-expert tensors and ``mlp.moe_statics.e_score_correction_bias [1, E]``.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from moeserve.models.checkpoint import EXPERTS_PREFIX, CheckpointReader
from moeserve.models.config import CheckpointError, ModelConfig, load_config
from moeserve.models.moe import ExpertSpec

LOAD_FORMATS = ("auto", "dummy")
LOW, HIGH = -1e-3, 1e-3                    # vLLM's dummy init range
FP32_NAMES = ("mlp.gate.weight", "e_score_correction_bias")   # stored in fp32 in ERNIE checkpoints


def open_reader(path: str | Path, load_format: str = "auto", device: torch.device | str = "cpu",
                seed: int = 0) -> CheckpointReader | DummyReader:
    """The reader for ``load_format``: "auto" reads the checkpoint files (on the CPU; callers
    move tensors), "dummy" makes seeded random weights on ``device``."""
    if load_format == "auto":
        return CheckpointReader(path)
    if load_format == "dummy":
        return DummyReader(path, seed=seed, device=device)
    raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")


def tensor_seed(seed: int, key: str) -> int:
    """A 63-bit generator seed from (seed, key), the same in every process (not Python's hash)."""
    return int.from_bytes(hashlib.sha256(f"{seed}\0{key}".encode()).digest()[:8], "little") >> 1


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every text-model tensor a checkpoint of ``cfg`` holds, and its shape (published layouts)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    e, i = cfg.num_experts, cfg.moe_intermediate_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}

    def linear(name: str, o: int, n: int, bias: bool) -> None:
        out[f"{name}.weight"] = (o, n)
        if bias:
            out[f"{name}.bias"] = (o,)

    def swiglu(prefix: str, width: int, bias: bool) -> None:
        linear(f"{prefix}.gate_proj", width, h, bias)
        linear(f"{prefix}.up_proj", width, h, bias)
        linear(f"{prefix}.down_proj", h, width, bias)

    llama = cfg.family == "llama4"
    ffn = "feed_forward" if llama else "mlp"
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}"
        for n, o, k in (("q", q, h), ("k", kv, h), ("v", kv, h), ("o", h, q)):
            linear(f"{p}.self_attn.{n}_proj", o, k, cfg.attention_bias)
        out[f"{p}.input_layernorm.weight"] = (h,)
        out[f"{p}.post_attention_layernorm.weight"] = (h,)
        if cfg.moe_index(layer) is None:
            swiglu(f"{p}.{ffn}", cfg.intermediate_size, cfg.mlp_bias)
            continue
        experts = EXPERTS_PREFIX[cfg.family].format(layer)
        if llama:
            out[f"{p}.feed_forward.router.weight"] = (e, h)
            out[experts + "gate_up_proj"] = (e, h, 2 * i)
            out[experts + "down_proj"] = (e, i, h)
            swiglu(f"{p}.feed_forward.shared_expert", i, False)
        else:
            out[f"{p}.mlp.gate.weight"] = (e, h)
            out[f"{p}.mlp.moe_statics.e_score_correction_bias"] = (1, e)
            for x in range(e):
                out[f"{experts}{x}.gate_proj.weight"] = (i, h)
                out[f"{experts}{x}.up_proj.weight"] = (i, h)
                out[f"{experts}{x}.down_proj.weight"] = (h, i)
            if cfg.num_shared_experts:
                swiglu(f"{p}.mlp.shared_experts", cfg.shared_intermediate_size, cfg.mlp_bias)
    if not cfg.tie_word_embeddings:
        linear("lm_head", v, h, cfg.mlp_bias)
    elif cfg.mlp_bias:
        out["lm_head.bias"] = (v,)
    return out


class DummyReader:
    """A checkpoint folder's ``config.json``, read as if its weights were seeded random numbers.

    ``device``: where every tensor is made (the caller's ``.to(device)`` is then a no-op);
    ``seed``: with the tensor's name, the seed of its generator.
    """

    prefix = ""

    def __init__(self, path: str | Path, seed: int = 0, device: torch.device | str = "cpu"):
        self.path = Path(path)
        self.config: ModelConfig = load_config(self.path)
        self.seed = int(seed)
        self.device = torch.device(device)
        self.bytes_read = 0
        self.tensors_read = 0
        self._shapes = checkpoint_shapes(self.config)

    def close(self) -> None:
        """Hand the float32 temporaries back to the device, so that what is free afterwards (the
        KV cache is sized from it) is not held in torch's cache."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> DummyReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- tensors -------------------------------------------------------------------------------

    def names(self) -> list[str]:
        return sorted(self._shapes)

    def has(self, name: str) -> bool:
        return name in self._shapes

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[self._known(name)]

    def stored_dtype(self, name: str) -> torch.dtype:
        self._known(name)
        return torch.float32 if name.endswith(FP32_NAMES) else self.config.dtype

    def check_shape(self, name: str, expected: tuple[int, ...]) -> None:
        found = self.shape(name)
        if tuple(found) != tuple(expected):
            raise CheckpointError(f"{self._source}: tensor '{name}' has shape {list(found)}, expected {list(expected)}")

    def read(self, name: str, dtype: torch.dtype | None = None,
             shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """One whole tensor (a fused expert tensor: its experts' rows stacked), made on the device."""
        if shape is not None:
            self.check_shape(name, shape)
        full = self.shape(name)
        if self._fused(name):
            return self.read_rows(name, 0, full[0], dtype)
        return self._make(name, full, dtype or self.stored_dtype(name), ones=_is_norm(name))

    def read_rows(self, name: str, start: int, count: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows ``start .. start+count-1`` of dim 0: [count, *shape[1:]]. A fused expert tensor's
        rows are made one expert at a time (each its own generator), so reading one expert and
        reading the whole tensor agree."""
        full = self.shape(name)
        if not full or not 0 <= start <= start + count <= full[0]:
            raise CheckpointError(f"{self._source}: tensor '{name}' of shape {full} has no rows {start}..{start + count - 1}")
        dtype = dtype or self.stored_dtype(name)
        if self._fused(name):
            rows = [self._make(f"{name}[{r}]", full[1:], dtype) for r in range(start, start + count)]
            if not rows:
                return torch.empty((0, *full[1:]), dtype=dtype, device=self.device)
            return torch.stack(rows) if count > 1 else rows[0].unsqueeze(0)
        return self.read(name, dtype)[start:start + count].clone()

    # -- routed experts (as CheckpointReader: canonical gate_up [H, 2I], down [I, H]) --------------

    def _experts_prefix(self, moe_layer: int) -> str:
        cfg = self.config
        if not 0 <= moe_layer < cfg.num_moe_layers:
            raise ValueError(f"MoE layer index {moe_layer} out of range 0..{cfg.num_moe_layers - 1} "
                             f"(the ordinal among MoE layers, not the decoder-layer index)")
        return EXPERTS_PREFIX[cfg.family].format(cfg.moe_layer_ids[moe_layer])

    def expert_layout(self, moe_layer: int) -> str:
        return "fused" if self.has(self._experts_prefix(moe_layer) + "gate_up_proj") else "per_expert"

    def expert_spec(self, dtype: torch.dtype | None = None) -> ExpertSpec:
        cfg = self.config
        return ExpertSpec(cfg.hidden_size, cfg.moe_intermediate_size, "silu", False, dtype or cfg.dtype)

    def read_expert(self, moe_layer: int, expert: int, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        cfg = self.config
        h, i, n_exp = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        prefix = self._experts_prefix(moe_layer)
        if not 0 <= expert < n_exp:
            raise ValueError(f"logical expert id {expert} out of range 0..{n_exp - 1}")
        if self.expert_layout(moe_layer) == "fused":
            return {"gate_up": self.read_rows(prefix + "gate_up_proj", expert, 1, dtype)[0],     # [H, 2I]
                    "down": self.read_rows(prefix + "down_proj", expert, 1, dtype)[0]}           # [I, H]
        p = f"{prefix}{expert}."
        gate = self.read(p + "gate_proj.weight", dtype, shape=(i, h))                          # [I, H]
        up = self.read(p + "up_proj.weight", dtype, shape=(i, h))                              # [I, H]
        down = self.read(p + "down_proj.weight", dtype, shape=(h, i))                          # [H, I]
        return {"gate_up": torch.cat([gate.t(), up.t()], dim=1).contiguous(), "down": down.t().contiguous()}

    def read_experts(self, moe_layer: int, ids, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Several logical experts stacked in ``ids`` order: gate_up [N, H, 2I], down [N, I, H]."""
        ids = [int(e) for e in ids]
        if not ids:
            spec = self.expert_spec(dtype)
            return {k: torch.empty((0, *s), dtype=spec.dtype, device=self.device) for k, s in spec.shapes.items()}
        made = {e: self.read_expert(moe_layer, e, dtype) for e in dict.fromkeys(ids)}
        return {k: torch.stack([made[e][k] for e in ids]) for k in ("gate_up", "down")}

    # -- making ----------------------------------------------------------------------------------

    @property
    def _source(self) -> str:
        return f"{self.path} (load_format dummy)"

    def _known(self, name: str) -> str:
        if name not in self._shapes:
            raise CheckpointError(f"{self._source}: tensor '{name}' is missing (a checkpoint of this config.json "
                                  f"has no such tensor)")
        return name

    def _fused(self, name: str) -> bool:
        return self.config.family == "llama4" and name.endswith((".experts.gate_up_proj", ".experts.down_proj"))

    def _make(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, ones: bool = False) -> torch.Tensor:
        if ones:
            t = torch.ones(shape, dtype=dtype, device=self.device)
        else:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(tensor_seed(self.seed, key))
            t = torch.empty(shape, dtype=torch.float32, device=self.device).uniform_(LOW, HIGH, generator=gen)
            if dtype != torch.float32:
                t = t.to(dtype)
        self.bytes_read += t.numel() * t.element_size()
        self.tensors_read += 1
        return t


def _is_norm(name: str) -> bool:
    return name.endswith(("norm.weight", "layernorm.weight"))
