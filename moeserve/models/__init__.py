"""Models: Llama 4 (text), ERNIE-4.5-MoE, Qwen3-MoE, Mixtral and GPT-OSS, split at the
router/expert seam of moe.py.

- config.py: ``load_config`` / ``ModelConfig`` (both published and transformers-5 spellings),
  whose MoE layer is data (``RoutingSpec``, shared experts, the expert MLP);
- families.py and llama4.py, ernie45.py, qwen3_moe.py, mixtral.py, gpt_oss.py: each family's
  config mapping and where its checkpoints keep each tensor;
- routing.py: the routing function of every family and ``MoEBlock``, a MoE layer's router side;
- checkpoint.py: ``CheckpointReader``, a lazy safetensors reader (one expert = its own bytes);
- dummy.py: ``DummyReader``, its drop-in for ``--load-format dummy`` (seeded random weights made on
  the device from config.json alone);
- layers.py, cache.py: norms, RoPE, attention over the ``KVCache``, the varlen ``StepBatch``;
- paged.py, attention.py: the paged KV cache (``PagedKVCache``), a step's ``PagedBatch``, and
  batched attention over them (torch, or Triton on CUDA: ``moeserve.kernels.triton_attention``);
- model.py: ``load_model`` -> ``DecoderModel`` (step / forward / generate) and ``MoEInfo``;
- init.py: ``init_model`` writes a small random checkpoint without transformers.

The MoE layer index (0 .. num_moe_layers-1, the ordinal among MoE layers) is what the expert
side sees; ``MoEInfo.moe_layer_ids[m]`` is the decoder-layer index of MoE layer m.
"""

from moeserve.models.cache import KVCache, StepBatch
from moeserve.models.checkpoint import CheckpointReader
from moeserve.models.config import CheckpointError, ModelConfig, RopeConfig, load_config
from moeserve.models.dummy import LOAD_FORMATS, DummyReader, open_reader
from moeserve.models.init import init_model
from moeserve.models.model import DecoderModel, MoEInfo, load_model
from moeserve.models.paged import PagedBatch, PagedKVCache

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "DecoderModel",
    "DummyReader",
    "KVCache",
    "LOAD_FORMATS",
    "MoEInfo",
    "ModelConfig",
    "PagedBatch",
    "PagedKVCache",
    "RopeConfig",
    "StepBatch",
    "init_model",
    "load_config",
    "load_model",
    "open_reader",
]
