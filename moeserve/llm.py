"""vLLM's offline API on a moeserve cluster: ``from moeserve import LLM, SamplingParams``.

    llm = LLM(model="/models/ernie", tensor_parallel_size=2, enable_expert_parallel=True,
              enable_eplb=True, num_redundant_experts=32, eplb_window_size=1000, eplb_step_interval=100)
    out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=64))
    out[0].outputs[0].text, out[0].outputs[0].token_ids

``LLM`` takes vLLM's keywords and starts a ``LocalCluster`` of rank processes:
``tensor_parallel_size`` N (times ``data_parallel_size`` M) with ``enable_expert_parallel`` is
N x M co-located ranks, each a router with its own attention (data-parallel attention) and an
expert worker (one GPU each on CUDA, else gloo ranks on the CPU). With ``enable_eplb`` it also
runs the balancer (a child process on the leader's admin API) set to rearrange the experts every
``eplb_step_interval`` forward steps over the last ``eplb_window_size`` steps' load, as vLLM's
EPLB does (any plan that moves slots and does not lower balancedness is applied, moving as many
slots as it needs); each rearrangement is logged. Prompts are texts (the model folder's
tokenizer), ``{"prompt_token_ids": [...]}`` or ``{"prompt": text}``; ``chat`` renders messages
with the model's chat template. Results are vLLM's shapes: ``RequestOutput`` with
``prompt_token_ids``, ``prompt_logprobs`` and ``outputs``, each a ``CompletionOutput`` with
``text``, ``token_ids``, ``logprobs`` (per token, id -> ``Logprob``), ``cumulative_logprob``,
``finish_reason`` and ``stop_reason``.

``SamplingParams`` here is vLLM's (its names and defaults: temperature 1.0, max_tokens 16, n,
stop strings, logit_bias as a dict, ...), not the engine's ``moeserve.sampling.SamplingParams``
it becomes; values are checked as the engine's are (ValueError naming the range).
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moeserve import sampling as engine_sampling

log = logging.getLogger("moeserve.llm")

# vLLM keywords moeserve takes without a setting of its own, and why they change nothing here
ACCEPTED = {
    "trust_remote_code": "moeserve runs its own model code",
    "tokenizer_mode": "the model folder's tokenizer.json is the tokenizer",
    "disable_log_stats": "moeserve logs no per-interval stats",
    "swap_space": "a preempted sequence is recomputed, never swapped",
    "enable_chunked_prefill": "prefill is always chunked by max_num_batched_tokens",
    "disable_custom_all_reduce": "moeserve runs no all-reduce",
    "compilation_config": "moeserve compiles no graphs but CUDA graphs of decode steps",
    "max_seq_len_to_capture": "decode graphs are captured per batch bucket",
    "distributed_executor_backend": "ranks are processes on this host",
}


@dataclass
class SamplingParams:
    """vLLM's sampling parameters (its names and defaults). ``top_k`` 0 or -1: all tokens;
    ``stop``: strings that end the text (not included unless ``include_stop_str_in_output``);
    ``logprobs``: top tokens per generated token; ``prompt_logprobs``: per prompt token."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= 64:
            raise ValueError(f"n must be an integer in 1..64, got {self.n!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 1024):
                raise ValueError(f"{name} must be None or an integer in 0..1024, got {v!r}")
        self.engine(0)  # the engine's checks: ranges named

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def engine(self, j: int) -> engine_sampling.SamplingParams:
        """The engine's parameters of choice ``j`` (seed + j, as the HTTP API does)."""
        return engine_sampling.SamplingParams(
            temperature=float(self.temperature),
            top_p=float(self.top_p),
            top_k=0 if self.top_k in (-1, 0) else self.top_k,
            seed=None if self.seed is None else self.seed + j,
            min_p=float(self.min_p),
            presence_penalty=float(self.presence_penalty),
            frequency_penalty=float(self.frequency_penalty),
            repetition_penalty=float(self.repetition_penalty),
            min_tokens=self.min_tokens,
            logit_bias=tuple(sorted((int(t), float(b)) for t, b in (self.logit_bias or {}).items())),
        )


@dataclass
class Logprob:
    """A token's logprob (of the raw logits), its rank among the vocabulary (1: most likely)
    and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" or "length" (vLLM's; "abort" when cancelled)
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True


class LLM:
    """A moeserve cluster for offline generation, built from vLLM's keywords (module
    docstring). Other vLLM keywords in :data:`ACCEPTED` are taken and change nothing (each says
    why); any other keyword is a TypeError. ``shutdown()`` stops every process (also at exit)."""

    def __init__(
        self,
        model: str,
        *,
        tokenizer: str | None = None,
        skip_tokenizer_init: bool = False,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        dtype: str = "auto",
        quantization: str | None = None,
        revision: str | None = None,
        tokenizer_revision: str | None = None,
        download_dir: str | None = None,
        seed: int | None = None,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        block_size: int | None = None,
        num_gpu_blocks_override: int | None = None,
        enable_prefix_caching: bool | None = None,
        load_format: str = "auto",
        enable_eplb: bool = False,
        num_redundant_experts: int | None = None,
        eplb_window_size: int | None = None,
        eplb_step_interval: int | None = None,
        eplb_log_balancedness: bool | None = None,
        eplb_config: dict | None = None,
        async_scheduling: bool | None = None,
        kv_cache_dtype: str = "auto",
        generation_config: str = "auto",
        **kwargs: Any,
    ):
        from moeserve.cli.serve import DTYPE_NAMES, _dtype
        from moeserve.cluster.launcher import LocalCluster
        from moeserve.models import load_config
        from moeserve.ops import hub
        from moeserve.services.tokenizer import ModelTokenizer, generation_defaults

        _log_to_stderr()
        unknown = sorted(set(kwargs) - set(ACCEPTED))
        if unknown:
            raise TypeError(f"LLM got keywords moeserve does not take: {unknown}")
        for k in kwargs:
            log.info("%s: accepted, changes nothing here (%s)", k, ACCEPTED[k])
        if kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: the KV cache is kept in the model's dtype ('auto')")
        if pipeline_parallel_size != 1:
            raise ValueError("pipeline_parallel_size must be 1: moeserve shards experts, not layers")
        if tensor_parallel_size > 1 and not enable_expert_parallel:
            raise ValueError(
                f"tensor_parallel_size {tensor_parallel_size} without enable_expert_parallel would split attention "
                f"and every expert over GPUs, which moeserve does not do: pass enable_expert_parallel=True"
            )
        n = tensor_parallel_size * data_parallel_size if enable_expert_parallel else data_parallel_size
        if n > 1 and not enable_expert_parallel:
            raise ValueError("data_parallel_size > 1 needs enable_expert_parallel=True (one expert-parallel cluster)")
        folder = hub.resolve(model, revision, download_dir)
        self.model_dir = str(folder)
        self.tokenizer = None
        if not skip_tokenizer_init:
            tok_dir = hub.resolve_tokenizer(tokenizer, tokenizer_revision, download_dir) if tokenizer else folder
            self.tokenizer = ModelTokenizer.load(tok_dir)
        self.defaults = {} if generation_config == "vllm" else generation_defaults(folder)
        mcfg = load_config(folder)
        ns = type("Args", (), {"dtype": dtype if dtype in DTYPE_NAMES else "auto"})()
        dt = _dtype(ns, folder) if dtype in DTYPE_NAMES else dtype
        backend = _backend(n)
        eplb: dict[str, Any] = dict(eplb_config or {})
        for key, value in (
            ("num_redundant_experts", num_redundant_experts),
            ("window_size", eplb_window_size),
            ("step_interval", eplb_step_interval),
            ("log_balancedness", eplb_log_balancedness),
        ):
            if value is not None:
                eplb[key] = value
        for key in ("use_async", "policy", "log_balancedness_interval"):
            eplb.pop(key, None)  # vLLM's: live moves and moeserve's policy are what moeserve does
        self.max_model_len = max_model_len or mcfg.max_position_embeddings
        limits: dict[str, Any] = {
            k: v
            for k, v in (
                ("max_num_seqs", max_num_seqs),
                ("max_num_batched_tokens", max_num_batched_tokens),
                ("block_size", block_size),
                ("num_gpu_blocks_override", num_gpu_blocks_override),
                ("enable_prefix_caching", enable_prefix_caching),
                ("async_scheduling", async_scheduling),
            )
            if v is not None
        }
        self._token = secrets.token_urlsafe(18)
        self.cluster = LocalCluster(
            folder,
            routers=n,
            workers=n,
            colocated=True,
            backend=backend,
            dtype=dt,
            enable_eplb=enable_eplb,
            max_model_len=self.max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            load_format=load_format,
            quantization=quantization or "",
            seed=seed,
            admin_port=0 if enable_eplb else -1,
            admin_token=self._token,
            **limits,
            **eplb,
        )
        log.info(
            "%d co-located rank%s on %s (%s), each a router with its own attention and an expert worker with "
            "1/%d of the experts%s",
            n,
            "s" if n > 1 else "",
            f"{n} GPUs" if backend == "nccl" else "the CPU",
            backend,
            n,
            f"; EPLB every {self.cluster.config.eplb.step_interval} steps" if enable_eplb else "",
        )
        self._balancer: subprocess.Popen | None = None
        self._stop = threading.Event()
        self.cluster.start()
        atexit.register(self.shutdown)
        if enable_eplb:
            self._start_balancer()
        self._version = int(self.cluster.placement().version)
        self._watch = threading.Thread(target=self._watch_placement, name="llm-eplb-log", daemon=True)
        self._watch.start()

    # -- the balancer ---------------------------------------------------------------------------

    def _start_balancer(self) -> None:
        """The balancer as a child process on the leader's admin API, set as vLLM's EPLB
        behaves: every step_interval steps a plan over the window, applied whenever it moves
        something without lowering balancedness, as many slots as it needs."""
        from moeserve.cli.up import wait_serving
        from moeserve.ops.ports import free_port
        from moeserve.ops.procs import child_env, module_command, set_death_signal

        assert self.cluster.admin_address is not None
        host, port = self.cluster.admin_address
        eplb = self.cluster.config.eplb
        bport = free_port()
        cmd = [
            *module_command("moeserve", "balancer"),
            "--balancer-port",
            str(bport),
            "--admin-address",
            f"{host}:{port}",
            "--eplb-window-size",
            str(eplb.window_size),
            "--eplb-step-interval",
            str(eplb.step_interval),
            "--eplb-min-gain",
            "0",
            "--eplb-move-cost",
            "0",
            "--eplb-move-budget",
            "1",
            "--balancer-poll-interval",
            "0.1",
        ]
        env = child_env(MOESERVE_ADMIN_TOKEN=self._token, MOESERVE_PARENT_PID=str(os.getpid()))
        logs = self.cluster.log_dir or self.cluster.run_dir or "."
        with open(os.path.join(logs, "balancer.log"), "ab") as out:
            self._balancer = subprocess.Popen(
                cmd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=set_death_signal,
            )
        wait_serving(
            f"127.0.0.1:{bport}", 120, alive=lambda: self._balancer is not None and self._balancer.poll() is None
        )

    def _watch_placement(self) -> None:
        """Log every rearrangement of the experts (a new placement version), as vLLM logs its."""
        while not self._stop.wait(0.5):
            try:
                p = self.cluster.placement()
            except Exception:
                return
            if int(p.version) != self._version:
                self._version = int(p.version)
                st = self.cluster.status()
                log.info(
                    "EPLB rearranged the experts: placement version %d after %d forward steps",
                    self._version,
                    st.forward_steps,
                )

    def placement_version(self) -> int:
        return int(self.cluster.placement().version)

    def shutdown(self) -> None:
        """Stop the balancer and the ranks (idempotent; also at interpreter exit); the last
        rearrangement not logged yet is logged first."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            version = self.placement_version() if self.cluster.alive else self._version
        except Exception:
            version = self._version
        if version != self._version:
            self._version = version
            log.info("EPLB rearranged the experts: placement version %d", version)
        if self._balancer is not None and self._balancer.poll() is None:
            self._balancer.terminate()
            try:
                self._balancer.wait(10)
            except subprocess.TimeoutExpired:
                self._balancer.kill()
        self.cluster.stop()

    # -- generation -----------------------------------------------------------------------------

    def get_tokenizer(self):
        return self.tokenizer

    def _prompt(self, p) -> tuple[str | None, list[int]]:
        if isinstance(p, str):
            return p, self._encode(p, True)
        if isinstance(p, dict) and "prompt_token_ids" in p:
            return p.get("prompt"), [int(t) for t in p["prompt_token_ids"]]
        if isinstance(p, dict) and isinstance(p.get("prompt"), str):
            return p["prompt"], self._encode(p["prompt"], True)
        if isinstance(p, (list, tuple)) and p and all(isinstance(t, int) for t in p):
            return None, [int(t) for t in p]
        raise TypeError(f"a prompt is a text, a list of token ids or {{'prompt_token_ids': [...]}}, got {p!r}")

    def _encode(self, text: str, special: bool) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this LLM has no tokenizer (skip_tokenizer_init): give prompt_token_ids")
        return self.tokenizer.encode(text, special)

    def default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults, then the model's generation_config.json (generation_config='auto')."""
        d = dict(self.defaults)
        if "max_tokens" in d:
            d["max_tokens"] = int(d["max_tokens"])
        return SamplingParams(**d)

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = False, **_) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order; every prompt and choice runs concurrently."""
        single = isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
        )
        items = [prompts] if single else list(prompts)
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(items)
        if len(params) != len(items):
            raise ValueError(f"{len(params)} sampling params for {len(items)} prompts")
        parsed = [self._prompt(p) for p in items]
        jobs = [(i, j) for i, sp in enumerate(params) for j in range(sp.n)]
        results: dict[tuple[int, int], tuple] = {}
        with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), 256))) as pool:
            futures = {job: pool.submit(self._run_one, parsed[job[0]][1], params[job[0]], job[1]) for job in jobs}
            for job, fut in futures.items():
                results[job] = fut.result()
        out = []
        for i, ((text, ids), sp) in enumerate(zip(parsed, params)):
            choices = [results[i, j][0] for j in range(sp.n)]
            plp = results[i, 0][1]
            out.append(RequestOutput(str(i), text, ids, plp, choices))
        return out

    def chat(self, messages, sampling_params=None, add_generation_prompt: bool = True, chat_template_kwargs=None, **_):
        """``messages`` (one conversation, or a list of them) rendered with the model's chat
        template, then generated as ``generate`` does."""
        if self.tokenizer is None:
            raise ValueError("chat needs the model's tokenizer")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in convs:
            text = self.tokenizer.render_chat(list(conv), add_generation_prompt, chat_template_kwargs)
            prompts.append({"prompt": text, "prompt_token_ids": self._encode(text, False)})
        return self.generate(prompts, sampling_params)

    def _run_one(self, ids: list[int], sp: SamplingParams, j: int):
        """Choice ``j`` of one prompt through its own request stream (a stop string cancels it)."""
        from moeserve.router.engine.api import Failed, Finished, FinishReason, GenerateRequest, Token
        from moeserve.router.engine.channel import ClusterError
        from moeserve.services.tokenizer import Detokenizer, StopStrings

        max_tokens = sp.max_tokens if sp.max_tokens is not None else max(1, self.max_model_len - len(ids))
        req = GenerateRequest(
            prompt_ids=tuple(ids),
            max_tokens=max_tokens,
            sampling=sp.engine(j),
            stop_token_ids=tuple(sp.stop_token_ids or ()),
            ignore_eos=sp.ignore_eos,
            return_logits="last" if sp.logprobs is not None else "",
            prompt_logprobs=-1 if sp.prompt_logprobs is None else sp.prompt_logprobs,
        )
        detok = Detokenizer(self.tokenizer, sp.skip_special_tokens)
        stops = StopStrings(sp.stops)
        text = ""
        lps: list[dict[int, Logprob]] | None = [] if sp.logprobs is not None else None
        plp = None
        reason: str | None = None
        stop_reason: int | str | None = None
        stream = self.cluster._c().open_stream([req])
        try:
            for _, ev in stream:
                if isinstance(ev, Token):
                    if ev.prompt_logprobs is not None:
                        plp = self._prompt_lps(ids, ev.prompt_logprobs, sp.prompt_logprobs or 0)
                    if lps is not None and ev.logits is not None:
                        lps.append(self._token_lps(ev.token_id, ev.logits[-1], sp.logprobs or 0))
                    detok.add(ev.token_id)
                    new, stopped = stops.feed(detok.text, match=len(detok.ids) >= sp.min_tokens)
                    text += new
                    if stopped:
                        reason, stop_reason = "stop", stops.matched
                        text += (stops.matched or "") if sp.include_stop_str_in_output else ""
                        stream.cancel()
                        break
                    if ev.token_id in (sp.stop_token_ids or ()):
                        stop_reason = ev.token_id
                elif isinstance(ev, Finished):
                    detok.flush()
                    new, stopped = stops.feed(detok.text, final=True, match=len(detok.ids) >= sp.min_tokens)
                    text += new
                    if stopped:
                        reason, stop_reason = "stop", stops.matched
                        text += (stops.matched or "") if sp.include_stop_str_in_output else ""
                    else:
                        reason = {FinishReason.CANCELLED: "abort"}.get(ev.reason, str(ev.reason))
                        if reason != "stop":
                            stop_reason = None
                elif isinstance(ev, Failed):
                    raise ClusterError(ev.message)
        finally:
            stream.cancel()
        cum = float(sum(d[t].logprob for d, t in zip(lps, detok.ids))) if lps is not None else None
        return CompletionOutput(j, text, list(detok.ids), cum, lps, reason, stop_reason), plp

    def _text(self, t: int) -> str | None:
        return self.tokenizer.token_text(t) if self.tokenizer is not None else None

    def _token_lps(self, token: int, logits: np.ndarray, k: int) -> dict[int, Logprob]:
        x = np.asarray(logits, dtype=np.float64).reshape(-1)
        lp = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
        top = np.argsort(-lp, kind="stable")[:k]
        out = {int(t): Logprob(float(lp[t]), r + 1, self._text(int(t))) for r, t in enumerate(top)}
        out.setdefault(token, Logprob(float(lp[token]), int((lp > lp[token]).sum()) + 1, self._text(token)))
        return out

    def _prompt_lps(self, ids: list[int], plp, k: int) -> list[dict[int, Logprob] | None]:
        out: list[dict[int, Logprob] | None] = [None]
        for i, t in enumerate(ids[1:]):
            d = {
                int(a): Logprob(float(b), r + 1, self._text(int(a)))
                for r, (a, b) in enumerate(zip(plp.top_ids[i][:k], plp.top_logprobs[i][:k]))
            }
            d.setdefault(int(t), Logprob(float(plp.logprob[i]), int(plp.rank[i]), self._text(int(t))))
            out.append(d)
        return out


def _log_to_stderr() -> None:
    """INFO lines of this module on stderr, as vLLM's offline API prints its own, unless the
    application configured logging."""
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def _backend(n: int) -> str:
    """nccl with a GPU per rank, gloo on the CPU when there is no GPU; ValueError when GPUs are
    visible but fewer than the ranks."""
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        gpus = 0
    if gpus and n > gpus:
        raise ValueError(f"{n} ranks need {n} GPUs (one per rank); {gpus} are visible (CUDA_VISIBLE_DEVICES)")
    return "nccl" if gpus else "gloo"


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "ACCEPTED"]
