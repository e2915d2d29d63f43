"""CUDA-graph capture of the static decode step (``layers.StaticStep``: device-side position, row lengths and
budgets, so no shape depends on the number of tokens).

``StaticRun`` runs one session's static steps: the first eagerly, the next captured, the rest replayed.  A step
with no host part is one CUDA graph.  MagicPIG's step waits on the host in each sparse layer (its CPU part), so it
is captured in ``Pieces`` cut there: one graph from each layer's CPU part to the next, replayed in order with the
CPU parts between them.  DS-Offload's static step (the predicted rows gathered from pinned host memory on a side
stream, the new token written there by a kernel at the device-side position) has no host part and is captured
whole.  ``replay_interleaved`` replays two independent decodes' pieces interleaved, so that the GPU runs one's
pieces while the host runs the other's CPU parts.
"""

from __future__ import annotations

import inspect
import time
from typing import Any

import torch

from .layers import StaticStep
from .session import SystemSession, use


class Pieces:
    """A decode step captured as a chain of CUDA graphs cut where it waits on the host.

    ``begin``, then the step's Python code runs as usual: its GPU work is recorded into the current piece until a
    layer calls ``SystemSession.cut(host_part)``; ``cut`` ends that piece, replays it at once (so the step's data
    exist), waits for it, runs ``host_part`` and begins the next piece; ``end`` closes the last one.  The capturing
    step therefore also decodes one token.  ``replay`` runs a later step: each piece, then (after its copies to the
    host have landed) its host part.  All pieces share one memory pool and always replay in capture order, so a
    tensor that one piece makes and the next reads keeps its address."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.hosts: list[Any] = []
        self._g: torch.cuda.CUDAGraph | None = None
        # host seconds over the replays: waiting for a piece to finish, and running the host parts
        self.wait_s = self.host_s = 0.0

    def begin(self) -> None:
        self._g = torch.cuda.CUDAGraph()
        self._g.capture_begin(pool=self.pool)

    def cut(self, host_part) -> None:
        self._close(host_part)
        torch.cuda.current_stream().synchronize()
        host_part()
        self.begin()

    def end(self) -> None:
        self._close(None)

    def abort(self) -> None:
        """Leave capture mode after an error inside a piece (the stream would refuse all later work)."""
        g, self._g = self._g, None
        if g is not None:
            try:
                g.capture_end()
            except RuntimeError:  # the capture was invalidated by the error itself
                pass

    def _close(self, host_part) -> None:
        g, self._g = self._g, None
        g.capture_end()
        self.graphs.append(g)
        self.hosts.append(host_part)
        g.replay()

    def replay(self) -> None:
        stream = torch.cuda.current_stream()
        for g, host_part in zip(self.graphs, self.hosts):
            g.replay()
            if host_part is not None:
                self._host(stream.synchronize, host_part)

    def _host(self, wait, host_part) -> None:
        t0 = time.perf_counter()
        wait()
        t1 = time.perf_counter()
        host_part()
        self.wait_s += t1 - t0
        self.host_s += time.perf_counter() - t1


def replay_interleaved(chains: list[Pieces]) -> None:
    """One step of several independent decodes (disjoint rows, each captured in pieces), interleaved so that the
    GPU runs one chain's piece while the host runs another's host part.  Chain c's piece i + 1 is enqueued as soon
    as its host part i has run, and that host part waits only for its own piece i (an event recorded after it), so
    with two chains A and B the GPU runs A0 B0 A1 B1 ... while the host runs A's part i during B's piece i and B's
    part i during A's piece i + 1.  Every chain has the same number of pieces (same model and method)."""
    n = len(chains[0].graphs)
    if any(len(c.graphs) != n for c in chains):
        raise ValueError(f"interleaved chains have {[len(c.graphs) for c in chains]} pieces: must be equal")
    stream = torch.cuda.current_stream()
    done = []
    for c in chains:
        c.graphs[0].replay()
        done.append(stream.record_event())
    for i in range(n - 1):
        for k, c in enumerate(chains):
            c._host(done[k].synchronize, c.hosts[i])
            c.graphs[i + 1].replay()
            done[k] = stream.record_event()


class StaticRun:
    """The static-shape decode steps (``layers.StaticStep``) of one session: ``warm`` runs the first step eagerly (on
    CUDA on a side stream, as graph capture wants: Triton compiles there), ``capture`` records the next one (a whole
    CUDA graph, not run; or, for a step with host parts such as MagicPIG's, ``Pieces``, which also decodes),
    ``replay`` runs a later one.  On the CPU every step runs the same static code eagerly.  ``out`` holds the tokens
    [B, 1] of the steps run; ``close`` hands the layers back to eager decoding."""

    def __init__(self, model: Any, session: SystemSession, kw: dict[str, Any], nxt: torch.Tensor, cuda: bool):
        self.model, self.session, self.cuda = model, session, cuda
        self.st = StaticStep(session.layers[0].n, nxt.shape[0], nxt.device)
        for layer in session.layers:
            layer.static = self.st
        self.ids = nxt.clone()  # [B, 1] static input of every step
        self.fkw = dict(kw, position_ids=self.st.pos.view(1, 1), use_cache=True, logits_to_keep=1)
        if "cache_position" in inspect.signature(model.forward).parameters:  # transformers < 5.24
            self.fkw["cache_position"] = self.st.pos
        self.out: list[torch.Tensor] = []
        self.pieces: Pieces | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.in_pieces = cuda and any(getattr(layer, "cuts_step", False) for layer in session.layers)

    def step(self) -> None:
        use(self.model, self.session)  # the attention modules decode with this session's layers
        logits = self.model(input_ids=self.ids, **self.fkw).logits[:, -1]
        self.ids.copy_(logits.argmax(-1, keepdim=True))
        self.st.advance()

    def warm(self) -> None:
        if self.cuda:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.step()
            torch.cuda.current_stream().wait_stream(side)
        else:
            self.step()
        self.out.append(self.ids.clone())

    def capture(self) -> dict[str, float]:
        """Capture the next step (CUDA only); returns ``graph_capture_ms`` (and ``graph_pieces``).  In pieces, the
        capturing step decodes a token (in ``out``); a whole graph is recorded without running."""
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if self.in_pieces:
            pieces = Pieces()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            self.session.pieces = pieces
            try:
                with torch.cuda.stream(side):
                    pieces.begin()
                    self.step()  # recorded piece by piece, each piece run once right after its capture
                    pieces.end()
            except BaseException:
                pieces.abort()
                raise
            finally:
                self.session.pieces = None
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            self.pieces = pieces
            self.out.append(self.ids.clone())
            return {"graph_capture_ms": 1e3 * (time.perf_counter() - t0), "graph_pieces": len(pieces.graphs)}
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step()  # recorded, not run
        torch.cuda.synchronize()
        return {"graph_capture_ms": 1e3 * (time.perf_counter() - t0)}

    def replay(self) -> None:
        if self.pieces is not None:
            self.pieces.replay()
        elif self.graph is not None:
            self.graph.replay()
        else:
            self.step()
        self.out.append(self.ids.clone())

    def close(self) -> None:
        for layer in self.session.layers:
            layer.static = None
            layer.n += len(self.out)
