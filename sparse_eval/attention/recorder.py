"""Accumulates per-row attention statistics per layer and head, on the device, until a sample ends."""

from __future__ import annotations

import math
from typing import Any

import torch

# statistics averaged over the query rows of sparse calls (one row = one query position of one head)
MEAN_KEYS = ("cost1", "cost2", "static_frac", "error", "mass", "topk_recall")


class StatsRecorder:
    def __init__(self, num_layers: int, num_heads: int):
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.reset()

    def reset(self) -> None:
        # per layer: {stat keys of a call: [1 + S, Hq] running sums (row 0: rows with valid keys)}
        self._stacked: dict[int, dict[tuple[str, ...], torch.Tensor]] = {}

    def add(self, layer: int, stats: dict[str, Any]) -> None:
        """stats: per-row tensors [B, Hq, Q] plus ``rows`` (bool, row has valid keys) and ``empty``.

        All statistics of a call are reduced in one stacked multiply-sum and accumulated in one addition (few
        kernel launches per layer); they are split by name only in ``summary``."""
        rows = stats["rows"]
        keys = tuple(k for k, v in stats.items()
                     if k not in ("rows", "keep") and torch.is_tensor(v) and v.shape == rows.shape)
        w = rows.to(torch.float32)
        mat = torch.stack([w] + [stats[k].to(torch.float32) for k in keys])  # [1 + S, B, Hq, Q]
        sums = (mat * w).sum((1, 3))  # [1 + S, Hq]
        table = self._stacked.setdefault(layer, {})
        table[keys] = table[keys] + sums if keys in table else sums

    def add_full(self, layer: int, static: torch.Tensor, n_valid: torch.Tensor, num_heads: int) -> None:
        """Full attention in a would-be-sparse call: every valid key is attended, the output is exact."""
        rows = (n_valid > 0).squeeze(-1).expand(-1, num_heads, -1)  # [B, Hq, Q]
        frac = (static.sum(-1).float() / n_valid.squeeze(-1).clamp_min(1).float()).expand(-1, num_heads, -1)
        zeros = torch.zeros_like(frac)
        ones = torch.ones_like(frac)
        self.add(layer, {"rows": rows, "empty": torch.zeros_like(rows), "cost1": zeros, "cost2": ones,
                         "static_frac": frac, "error": zeros, "mass": ones, "topk_recall": ones})

    def _tables(self) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], dict[str, dict[int, torch.Tensor]]]:
        """(rows, empty, sums) per layer ([Hq] each), from the stacked running sums."""
        rows: dict[int, torch.Tensor] = {}
        empty: dict[int, torch.Tensor] = {}
        sums: dict[str, dict[int, torch.Tensor]] = {}
        for layer, entries in self._stacked.items():
            for keys, acc in entries.items():
                rows[layer] = rows[layer] + acc[0] if layer in rows else acc[0]
                for i, key in enumerate(keys, start=1):
                    table = empty if key == "empty" else sums.setdefault(key, {})
                    table[layer] = table[layer] + acc[i] if layer in table else acc[i]
        return rows, empty, sums

    def summary(self) -> dict[str, Any]:
        """Means over all recorded rows (sparse layers and heads), per-layer means and per-layer-head means."""
        rows, empty, sums = self._tables()
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
