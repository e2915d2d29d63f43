"""The model side of a run: teacher-forced NLL and greedy generation under the evaluation protocol, for a batch
of samples at once.

Which forward passes are sparse (see ``attention.plugin``):
  A: prompt prefill dense, every generated token sparse;
  B: context prefill dense; question tokens and generated tokens sparse;
  S: everything sparse (prefill included).

A batch is left-padded.  Position ids count each row's own tokens (``mask.cumsum - 1``), the padding is masked
out of every attention call, and the session counts statistics only for a row's own query rows (padding, a
row's context under protocol B and a row that has stopped generating are excluded), so a sample's tokens,
scores and statistics are those it gets alone: bit for bit with the session's ``Runtime.batch_invariant`` (each
batch runs inside ``invariance.batch_invariant()``: fixed-order kernels whose reductions are aligned on a row's
last key, which left padding keeps in place), up to floating-point rounding without it:

* protocol B: each row's context ends at its own column; the columns where some rows are still in their
  context and others in their question run with a per-row phase (``session.phase(mask)``);
* ``prefill_chunk``: chunk boundaries are laid from the longest row's first token (under protocol B, the
  question's from the first context end), so rows whose padding differs by a multiple of the chunk see the
  calls they see alone.  Boundaries decide which keys a sparse call indexes, so the runner batches only such
  rows under protocol S, and under B runs a question longer than a chunk alone;
* generation stops per row (EOS, a stop string, ``max_new_tokens``); finished rows ride along unrecorded
  until every row has stopped.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..attention.plugin import SparseSession, cache_kwargs, make_cache
from ..invariance import batch_invariant
from ..models.placement import main_device
from .requests import (
    GenerationRequest,
    GenerationResult,
    LoglikelihoodRequest,  # noqa: F401 (re-exported)
    LoglikelihoodResult,
    row_seed,
)


class Engine:
    def __init__(self, model: Any, tokenizer: Any, session: SparseSession, prefill_chunk: int | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.session = session
        self.protocol = session.runtime.protocol
        self.prefill_chunk = prefill_chunk
        # where the batch's ids, masks, per-row tensors and logits live: the model's device, or for a model placed
        # over several (``model.device_map``) its input embeddings' (``placement.main_device``), where the whole
        # model would run on one device; the logits are read there, so greedy tokens, NLL and stopping are
        # computed where they are on one device
        self.device = main_device(model)
        self._cache_kw = next(iter(cache_kwargs(model, None)))  # "cache" (transformers >= 5.24) or "past_key_values"
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(tokenizer, "eos_token_id", None)
        self.pad_id = int(pad) if isinstance(pad, int) else 0

    # -- single samples (batch of one) ------------------------------------------------------------------------
    def nll(self, ids: Sequence[int]) -> tuple[float, int]:
        """Sum of next-token NLL over the window and the number of predicted tokens (len - 1)."""
        res = self.nll_batch([LoglikelihoodRequest(ids)])[0]
        return res.nll_sum, res.tokens

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        context_len: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        stop_strings: Sequence[str] | None = None,
    ) -> GenerationResult:
        return self.generate_batch(
            [GenerationRequest(prompt_ids, max_new_tokens, context_len, stop_token_ids, stop_strings)]
        )[0]

    def run_batch(self, requests: Sequence[GenerationRequest | LoglikelihoodRequest]) -> list[Any]:
        """Results of a batch of requests of one kind, in order."""
        if all(isinstance(r, LoglikelihoodRequest) for r in requests):
            return self.nll_batch(requests)  # type: ignore[arg-type]
        if all(isinstance(r, GenerationRequest) for r in requests):
            return self.generate_batch(requests)  # type: ignore[arg-type]
        raise TypeError(f"a batch holds requests of one kind; got {sorted({type(r).__name__ for r in requests})}")

    # -- the padded batch --------------------------------------------------------------------------------------
    def _layout(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-padded ids and mask [B, T] and each row's padding [B]."""
        lens = [len(p) for p in prompts]
        if min(lens) < 1:
            raise ValueError("an empty prompt cannot be evaluated")
        t = max(lens)
        ids = torch.full((len(prompts), t), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), t), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, t - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
            mask[i, t - len(p) :] = 1
        pads = torch.tensor([t - n for n in lens], dtype=torch.long)
        return ids.to(self.device), mask.to(self.device), pads.to(self.device)

    def _bounds(self, start: int, stop: int) -> list[tuple[int, int]]:
        """Chunk boundaries of the columns [start, stop): ``prefill_chunk`` columns each from ``start`` (column 0
        is the longest row's first token)."""
        step = self.prefill_chunk or max(1, stop - start)
        return [(s, min(stop, s + step)) for s in range(start, stop, step)]

    def _call(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        stop: int,
        start: int,
        cache: Any,
        phase: Any,
        counted: torch.Tensor,
        logits_to_keep: int | None = None,
    ) -> torch.Tensor:
        """One forward pass over the columns [start, stop) of the batch; ``counted`` bool [B, stop - start]: the
        query rows whose statistics are recorded."""
        pos = (mask[:, :stop].cumsum(-1) - 1).clamp_min(0)[:, start:stop]
        kw: dict[str, Any] = {self._cache_kw: cache} if cache is not None else {}
        if logits_to_keep is not None:
            kw["logits_to_keep"] = logits_to_keep
        with self.session.phase(phase), self.session.counting(counted):
            out = self.model(
                input_ids=ids[:, start:stop],
                attention_mask=mask[:, :stop],
                position_ids=pos,
                use_cache=cache is not None,
                **kw,
            )
        return out.logits.to(self.device)

    def _seed_rows(self, requests: Sequence[Any], pads: torch.Tensor) -> None:
        """Per row: its seed (from its sample id) and its first column (the left padding before it)."""
        self.session.row_seeds = torch.tensor([row_seed(r.key) for r in requests], dtype=torch.long, device=self.device)
        self.session.row_starts = pads

    # -- log-likelihood ----------------------------------------------------------------------------------------
    def invariant(self) -> Any:
        """The context of a batch: ``invariance.batch_invariant`` when the session's runtime asks for it."""
        return batch_invariant(self.session.runtime.batch_invariant)

    @torch.inference_mode()
    def nll_batch(self, requests: Sequence[LoglikelihoodRequest]) -> list[LoglikelihoodResult]:
        """Teacher-forced NLL of each window (protocol S: sparse; A and B: dense), in prefill chunks."""
        try:
            with self.invariant():
                return self._nll_batch(requests)
        finally:
            self.session.row_starts = None  # the starts of this batch only

    def _nll_batch(self, requests: Sequence[LoglikelihoodRequest]) -> list[LoglikelihoodResult]:
        ids, mask, pads = self._layout([r.input_ids for r in requests])
        self._seed_rows(requests, pads)
        b, t = ids.shape
        phase = "sparse" if self.protocol == "S" else "dense"
        cache = make_cache(self.model) if self.prefill_chunk else None
        real = mask.bool()
        predicted = real[:, :-1] & real[:, 1:]  # position t predicts t + 1 within the row
        nll = torch.zeros(b, dtype=torch.float64, device=self.device)
        for start, stop in self._bounds(0, t):
            logits = self._call(ids, mask, stop, start, cache, phase, real[:, start:stop])
            last = min(stop, t - 1)
            if last <= start:
                continue
            lp = torch.log_softmax(logits[:, : last - start].float(), dim=-1)
            tok = lp.gather(-1, ids[:, start + 1 : last + 1, None]).squeeze(-1)  # [B, W]
            nll -= (tok.double() * predicted[:, start:last]).sum(-1)
        counts = predicted.sum(-1)
        return [LoglikelihoodResult(float(nll[i]), int(counts[i])) for i in range(b)]

    # -- generation --------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate_batch(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Greedy decoding of a batch, each row stopping on its own (EOS, a stop string, ``max_new_tokens``)."""
        try:
            with self.invariant():
                return self._generate_batch(requests)
        finally:
            self.session.row_starts = None  # the starts of this batch only

    def _generate_batch(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        ids, mask, pads = self._layout([r.input_ids for r in requests])
        self._seed_rows(requests, pads)
        b, t = ids.shape
        real = mask.bool()
        cache = make_cache(self.model)
        logits = None
        if self.protocol == "B":
            if any(r.context_len is None for r in requests):
                raise ValueError("protocol B needs the task to say where the context ends (context_len)")
            ends = pads + torch.tensor([r.context_len for r in requests], dtype=torch.long, device=self.device)
            split = int(ends.min())
            for start, stop in self._bounds(0, split):
                logits = self._call(ids, mask, stop, start, cache, "dense", torch.zeros_like(real[:, start:stop]), 1)
            cols = torch.arange(t, device=self.device)
            question = (cols[None, :] >= ends[:, None]) & real  # [B, T]: each row's own question rows
            for start, stop in self._bounds(split, t):
                q = question[:, start:stop]
                phase = "sparse" if bool(q.all()) else q
                logits = self._call(ids, mask, stop, start, cache, phase, q, 1)
        else:
            phase = "sparse" if self.protocol == "S" else "dense"
            for start, stop in self._bounds(0, t):
                logits = self._call(ids, mask, stop, start, cache, phase, real[:, start:stop], 1)
        logits = logits[:, -1]
        stop_ids = [
            set(r.stop_token_ids if r.stop_token_ids is not None else _eos_ids(self.model, self.tokenizer))
            for r in requests
        ]
        outs: list[list[int]] = [[] for _ in requests]
        stopped = ["max_new_tokens"] * b
        live = [r.max_new_tokens > 0 for r in requests]
        # decode, one column per step: the mask's generated columns are laid out once and passed as a view, each
        # row's position is its previous one + 1 (the count of its real tokens - 1), and the rows counted are
        # rebuilt only when a row stops (None while every row is live)
        n = t
        mask = torch.cat([mask, mask.new_ones((b, max(r.max_new_tokens for r in requests)))], dim=1)
        pos = real.sum(-1, keepdim=True) - 1  # [B, 1]: each row's last prompt position
        counted: torch.Tensor | None = None
        counted_for = [True] * b
        kw = {self._cache_kw: cache}
        while any(live):
            tok = logits.argmax(-1, keepdim=True)  # [B, 1]
            nxt = tok.view(-1).tolist()
            for i, r in enumerate(requests):
                if not live[i]:
                    continue
                if nxt[i] in stop_ids[i]:
                    stopped[i], live[i] = "eos", False
                    continue
                outs[i].append(nxt[i])
                if r.stop_strings:
                    text = self.tokenizer.decode(outs[i], skip_special_tokens=True)
                    if any(s in text for s in r.stop_strings):
                        stopped[i], live[i] = "stop_string", False
                        continue
                if len(outs[i]) == r.max_new_tokens:
                    live[i] = False
            if not any(live):
                break
            if live != counted_for:
                counted_for = list(live)
                counted = torch.tensor(live, dtype=torch.bool, device=self.device)[:, None]
            n += 1
            pos = pos + 1
            with self.session.phase("sparse"), self.session.counting(counted), self.session.generation():
                logits = (
                    self.model(input_ids=tok, attention_mask=mask[:, :n], position_ids=pos, use_cache=True, **kw)
                    .logits[:, -1]
                    .to(self.device)
                )
        results = []
        for i, r in enumerate(requests):
            text = self.tokenizer.decode(outs[i], skip_special_tokens=True)
            if stopped[i] == "stop_string":
                text = text[: min(text.index(s) for s in r.stop_strings if s in text)]
            results.append(GenerationResult(tokens=outs[i], text=text, stopped_by=stopped[i]))
        return results


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids = getattr(model.generation_config, "eos_token_id", None) if hasattr(model, "generation_config") else None
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return list(ids) if isinstance(ids, (list, tuple)) else [int(ids)]
