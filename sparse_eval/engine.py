"""The model side of a run: teacher-forced NLL and greedy generation under the evaluation protocol.

Which forward passes are sparse (see ``attention.plugin``):
  A: prompt prefill dense, every generated token sparse;
  B: context prefill dense; question tokens and generated tokens sparse;
  S: everything sparse (prefill included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .attention.plugin import SparseSession, cache_kwargs, make_cache


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    stopped_by: str  # "eos", "stop_string", "max_new_tokens"


class Engine:
    def __init__(self, model: Any, tokenizer: Any, session: SparseSession, prefill_chunk: int | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.session = session
        self.protocol = session.runtime.protocol
        self.prefill_chunk = prefill_chunk
        self.device = next(model.parameters()).device
        self._cache_kw = next(iter(cache_kwargs(model, None)))  # "cache" (transformers >= 5.24) or "past_key_values"

    def _ids(self, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        t = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        return t.unsqueeze(0) if t.dim() == 1 else t

    def _forward(self, ids: torch.Tensor, cache: Any) -> torch.Tensor:
        """Runs ids [1, T] through the model in prefill chunks; returns the logits of every position."""
        step = self.prefill_chunk or ids.shape[1]
        logits = []
        for start in range(0, ids.shape[1], step):
            out = self.model(input_ids=ids[:, start:start + step], use_cache=cache is not None, **{self._cache_kw: cache})
            logits.append(out.logits)
        return logits[0] if len(logits) == 1 else torch.cat(logits, dim=1)

    @torch.inference_mode()
    def nll(self, ids: Sequence[int]) -> tuple[float, int]:
        """Sum of next-token NLL over the window and the number of predicted tokens (len - 1)."""
        x = self._ids(ids)
        phase = "sparse" if self.protocol == "S" else "dense"
        with self.session.phase(phase):
            cache = make_cache(self.model) if self.prefill_chunk else None
            logits = self._forward(x, cache)
        loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), x[0, 1:], reduction="sum")
        return float(loss), int(x.shape[1] - 1)

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        context_len: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        stop_strings: Sequence[str] | None = None,
    ) -> GenerationResult:
        """Greedy decoding.  ``context_len``: under protocol B, the first ``context_len`` prompt tokens are the
        context (dense) and the rest is the question (sparse); ignored under A and S."""
        x = self._ids(prompt_ids)
        cache = make_cache(self.model)
        if self.protocol == "B":
            if context_len is None:
                raise ValueError("protocol B needs the task to say where the context ends (context_len)")
            with self.session.phase("dense"):
                self._forward(x[:, :context_len], cache)
            with self.session.phase("sparse"):
                logits = self._forward(x[:, context_len:], cache)[:, -1]
        else:
            with self.session.phase("sparse" if self.protocol == "S" else "dense"):
                logits = self._forward(x, cache)[:, -1]
        stop_ids = set(stop_token_ids if stop_token_ids is not None else _eos_ids(self.model, self.tokenizer))
        out: list[int] = []
        stopped = "max_new_tokens"
        text = ""
        with self.session.phase("sparse"):
            for _ in range(max_new_tokens):
                nxt = int(logits.argmax(-1))
                if nxt in stop_ids:
                    stopped = "eos"
                    break
                out.append(nxt)
                if stop_strings:
                    text = self.tokenizer.decode(out, skip_special_tokens=True)
                    if any(s in text for s in stop_strings):
                        stopped = "stop_string"
                        break
                if len(out) == max_new_tokens:
                    break
                logits = self.model(input_ids=self._ids([nxt]), use_cache=True, **{self._cache_kw: cache}).logits[:, -1]
        text = self.tokenizer.decode(out, skip_special_tokens=True)
        if stopped == "stop_string":
            cut = min(text.index(s) for s in stop_strings if s in text)
            text = text[:cut]
        return GenerationResult(tokens=out, text=text, stopped_by=stopped)


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids = getattr(model.generation_config, "eos_token_id", None) if hasattr(model, "generation_config") else None
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return list(ids) if isinstance(ids, (list, tuple)) else [int(ids)]
