"""Accumulates per-row attention statistics per layer, head and batch row, on the device, until a batch ends.

Sums are kept per batch row (one sample of a padded batch), so ``summary(row=i)`` is sample i's statistics
alone: the rows a pass does not count (padding, other rows, a stopped row) carry weight 0."""

from __future__ import annotations

from typing import Any

import torch

# statistics averaged over the query rows of sparse calls (one row = one query position of one head)
MEAN_KEYS = ("cost1", "cost2", "kv_bytes", "static_frac", "est_error", "mass", "topk_recall")


class StatsRecorder:
    def __init__(self, num_layers: int, num_heads: int):
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.reset()

    def reset(self) -> None:
        # per layer: {(stat keys of a call, B): [1 + S, B, Hq] running sums (entry 0: counted rows with valid keys)}
        self._stacked: dict[int, dict[tuple[str, ...], torch.Tensor]] = {}
        self._host: dict[int, dict[tuple[str, ...], torch.Tensor]] | None = None  # ``_stacked`` on the host
        # per layer: {stat keys: float64 [1 + S, Hq]}: the rows of earlier batches of one sample (``archive_rows``)
        self._archive: dict[int, dict[tuple[str, ...], torch.Tensor]] = {}

    def archive_rows(self) -> None:
        """End of one batch among several that make one sample (lm-eval's own generation batches): its rows' sums
        are added, in float64 on the host, to the sample's archive, and the running tables start afresh, so that
        no two rows are ever summed in float32.  Each row's float32 sums are those it gets in any batch, and their
        float64 sum is exact while the values span less than about 2^29 in magnitude (true of these statistics
        over a few hundred rows), so ``summary()`` does not depend on how the rows were batched.  After this, only
        ``summary(row=None)`` is defined."""
        for layer, entries in self._stacked.items():
            arch = self._archive.setdefault(layer, {})
            for (keys, _), acc in entries.items():
                part = acc.to("cpu", torch.float64).sum(1)  # [1 + S, Hq]
                arch[keys] = arch[keys] + part if keys in arch else part
        self._stacked = {}
        self._host = None

    def add(self, layer: int, stats: dict[str, Any], counted: torch.Tensor | None = None) -> None:
        """stats: per-row tensors [B, Hq, Q] plus ``rows`` (bool, row has valid keys) and ``empty``;
        ``counted``: bool [B, 1, Q], the query rows to record (None: all).

        All statistics of a call are reduced in one stacked multiply-sum (``row_sums``) and accumulated in one
        addition (few kernel launches per layer); they are split by name only in ``summary``."""
        self.add_sums(layer, *self.row_sums(stats, counted))

    @staticmethod
    def row_sums(stats: dict[str, Any], counted: torch.Tensor | None = None) -> tuple[tuple[str, ...], torch.Tensor]:
        """(stat keys, sums fp32 [1 + S, B, Hq]) of one call's ``stats`` (as in ``add``): entry 0 counts the
        counted rows with valid keys, entry i the i-th key's values summed over those rows."""
        rows = stats["rows"]
        keys = tuple(
            k for k, v in stats.items() if k not in ("rows", "keep") and torch.is_tensor(v) and v.shape == rows.shape
        )
        w = rows if counted is None else rows & counted
        f32 = [t if t.dtype == torch.float32 else t.to(torch.float32) for t in (w, *(stats[k] for k in keys))]
        mat = torch.stack(f32)  # [1 + S, B, Hq, Q]
        w = f32[0]
        return keys, (mat * w).sum(3)  # [1 + S, B, Hq]

    def add_sums(self, layer: int, keys: tuple[str, ...], sums: torch.Tensor) -> None:
        """Accumulate one call's ``row_sums`` into ``layer``'s table (one addition; ``sums`` is never written)."""
        self._host = None
        table = self._stacked.setdefault(layer, {})
        entry = (keys, sums.shape[1])  # calls of another batch size (lm-eval's own batches) are summed apart
        table[entry] = table[entry] + sums if entry in table else sums

    def add_full(
        self,
        layer: int,
        static: torch.Tensor,
        n_valid: torch.Tensor,
        num_heads: int,
        counted: torch.Tensor | None = None,
        key_bytes: float | None = None,
    ) -> None:
        """Full attention in a would-be-sparse call: every valid key is attended, the output is exact.
        ``key_bytes``: one key's K and V rows, 2·D·e bytes (e = the cache dtype's element size); each row then
        records ``kv_bytes`` = n_valid · 2 · D · e (``core.kv_bytes_read`` of full attention)."""
        self.add_sums(layer, *self.full_sums(static, n_valid, num_heads, counted, key_bytes))

    @classmethod
    def full_sums(
        cls,
        static: torch.Tensor,
        n_valid: torch.Tensor,
        num_heads: int,
        counted: torch.Tensor | None = None,
        key_bytes: float | None = None,
    ) -> tuple[tuple[str, ...], torch.Tensor]:
        """``row_sums`` of a full-attention call (``add_full``): they depend only on the pass's masks, so every
        full layer of one pass can add the same sums."""
        rows = (n_valid > 0).squeeze(-1).expand(-1, num_heads, -1)  # [B, Hq, Q]
        frac = (static.sum(-1).float() / n_valid.squeeze(-1).clamp_min(1).float()).expand(-1, num_heads, -1)
        zeros = torch.zeros_like(frac)
        ones = torch.ones_like(frac)
        stats = {
            "rows": rows,
            "empty": torch.zeros_like(rows),
            "cost1": zeros,
            "cost2": ones,
            "static_frac": frac,
            "est_error": zeros,
            "mass": ones,
            "topk_recall": ones,
        }
        if key_bytes is not None:
            stats["kv_bytes"] = (n_valid.squeeze(-1).to(torch.float32) * float(key_bytes)).expand(-1, num_heads, -1)
        return cls.row_sums(stats, counted)

    def _tables(
        self, row: int | None
    ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], dict[str, dict[int, torch.Tensor]]]:
        """(rows, empty, sums) per layer ([Hq] each) of batch row ``row`` (None: all rows), from the stacked sums."""
        rows: dict[int, torch.Tensor] = {}
        empty: dict[int, torch.Tensor] = {}
        sums: dict[str, dict[int, torch.Tensor]] = {}
        if row is not None and len({b for entries in self._stacked.values() for _, b in entries}) > 1:
            raise ValueError("per-row statistics of calls with different batch sizes; reset between batches")
        if row is not None and self._archive:
            raise ValueError("per-row statistics after archive_rows(): the rows of several batches are pooled")
        if self._host is None:  # one copy per batch: the per-row summaries then run without device syncs
            self._host = {
                layer: {e: acc.cpu() for e, acc in entries.items()} for layer, entries in self._stacked.items()
            }
        live = [
            (layer, keys, acc.double().sum(1) if row is None else acc[:, row])  # [1 + S, Hq]
            for layer, entries in self._host.items()
            for (keys, _), acc in entries.items()
        ]
        archived = [(layer, keys, acc) for layer, entries in self._archive.items() for keys, acc in entries.items()]
        for layer, keys, acc in live + archived:
            rows[layer] = rows[layer] + acc[0] if layer in rows else acc[0]
            for i, key in enumerate(keys, start=1):
                table = empty if key == "empty" else sums.setdefault(key, {})
                table[layer] = table[layer] + acc[i] if layer in table else acc[i]
        return rows, empty, sums

    def batch_rows(self) -> int | None:
        """The batch size of the recorded calls (None before any, when calls of several sizes were recorded, or
        after ``archive_rows``)."""
        sizes = {b for entries in self._stacked.values() for _, b in entries}
        return sizes.pop() if len(sizes) == 1 and not self._archive else None

    def summary(self, row: int | None = None) -> dict[str, Any]:
        """Means over the recorded query rows (sparse layers and heads) of batch row ``row`` (None: of every
        row), per-layer means and per-layer-head means."""
        rows, empty, sums = self._tables(row)
        out: dict[str, Any] = {}
        layers = sorted(rows)
        total_rows = sum(float(rows[l].sum()) for l in layers)
        out["sparse_rows"] = total_rows
        out["empty_selections"] = sum(float(empty[l].sum()) for l in layers if l in empty)
        out["sparse_layers"] = layers
        for key, table in sums.items():
            tot = sum(float(table[l].sum()) for l in layers if l in table)
            out[key] = tot / total_rows if total_rows else None
            out[f"{key}_per_layer"] = {
                int(l): float(table[l].sum() / rows[l].sum().clamp_min(1)) for l in layers if l in table
            }
            out[f"{key}_per_layer_head"] = {
                int(l): (table[l] / rows[l].clamp_min(1)).tolist() for l in layers if l in table
            }
        return out
