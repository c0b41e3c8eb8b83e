"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` of the OpenAI-compatible HTTP API
(``moeserve.services.http``): a mixin of :class:`~moeserve.services.http.app.HttpApi`, which
supplies the body parsing, the API key check and the admission path (its tokenizer and limits)."""

from __future__ import annotations

from typing import Any

from moeserve.services.http.encode import bad, json_response
from moeserve.services.http.params import check_keys, parse_chat_options, parse_messages, parse_model


def _flag(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"{name} must be true or false, got {v!r}", name)
    return v


class TokenRoutes:
    """The routes that turn text into ids and back, with the model's tokenizer."""

    # what HttpApi supplies
    admission: Any
    served_models: list[str]
    _generation: Any
    _ignored: Any

    async def tokenize(self, request):
        """vLLM's POST /tokenize: ``prompt`` (with ``add_special_tokens``, default true) or
        ``messages`` (the chat template; ``add_generation_prompt``) -> {count, max_model_len,
        tokens, token_strs (with ``return_token_strs``)}."""
        return await self._generation(request, self._tokenize)

    async def _tokenize(self, body: dict):
        a = self.admission
        known = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"}
        known |= {"return_token_strs", "chat_template_kwargs", "continue_final_message"}
        self._ignored(check_keys(body, known), "/tokenize")
        parse_model(body, self.served_models)
        strs = _flag(body, "return_token_strs", False)
        if body.get("messages") is not None:
            add_gen, kwargs = parse_chat_options(body)
            ids = await a.chat_ids(parse_messages(body), add_gen, kwargs)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise bad(f"prompt must be a string (or give messages), got {type(prompt).__name__}", "prompt")
            ids = await a.encode(prompt, _flag(body, "add_special_tokens", True), allow_empty=True)
        tok = a.tokenizer
        return json_response(
            {
                "count": len(ids),
                "max_model_len": a.limits.max_model_len,
                "tokens": list(ids),
                "token_strs": [tok.tokenizer.id_to_token(t) for t in ids] if strs and tok is not None else None,
            }
        )

    async def detokenize(self, request):
        """vLLM's POST /detokenize: ``tokens`` (ids) -> {prompt: their text}."""
        return await self._generation(request, self._detokenize)

    async def _detokenize(self, body: dict):
        a = self.admission
        self._ignored(check_keys(body, {"model", "tokens"}), "/detokenize")
        parse_model(body, self.served_models)
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            raise bad("tokens must be a list of token ids", "tokens")
        ids = a.token_ids(tokens, "tokens")
        if a.tokenizer is None:
            raise bad("this server has no tokenizer: it cannot detokenize", "tokens")
        vocab = a.tokenizer.tokenizer.get_vocab_size()
        if any(not 0 <= t < vocab for t in ids):
            raise bad(f"tokens must be ids in 0..{vocab - 1}", "tokens")
        return json_response({"prompt": a.tokenizer.decode(ids, skip_special_tokens=False)})
