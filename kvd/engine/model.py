"""The reference models: a tiny hybrid target and an independent, smaller draft.

Both are plain torch with fixed-seed random weights; nothing is trained. Their KV shape *is*
the ``tiny-hybrid`` preset (:func:`layout_for` builds the layout from the two configs and a test
checks its fingerprint against the preset)::

    target  d_model 64, vocab 256, RoPE, 4 query heads over 2 KV heads (GQA), head_dim 16
            layer 0  swa   sliding window 32 tokens   -> group swa,   layer 0
            layer 1  full  full attention             -> group full,  layer 0
            layer 2  state h_t = decay * h_(t-1) + W_in x_t, 64 channels -> group state, slot
            layer 3  swa                              -> group swa,   layer 1
            layer 4  full                             -> group full,  layer 1
    draft   d_model 32, 2 query heads over 1 KV head, head_dim 16, page 8 tokens
            layer 0  full attention                   -> group draft, layer 0

The two models share a fixed "bigram prior" (both read ``prior[token]`` into their logits), as
if both had been trained on the same corpus; everything else is independent. That is what makes
the draft's guesses right often enough for speculative decoding to accept tokens.

Numerics. Activations are float64; KV and the recurrent state are stored float32 (the layout's
dtype) and are rounded to float32 the moment they are produced, *also* when they are used
in-flight before being written. So the attention of a token sees the same numbers whether its
keys came from the arena, from an earlier chunk or from the same forward pass, and the state
after a token does not depend on how the prompt was chunked. Prefill-decode and colocated runs
with the same engine settings are therefore bit-identical; runs that differ only in chunking or
speculation agree token for token (float64 leaves a last-bit difference, nowhere near an argmax).

Where KV lives: a forward pass never keeps a cache of its own. It reads the request's past KV
from the arena through :class:`kvd.engine.paged.SeqKV` (physical page ids from the daemon) and
returns the new positions' KV in a :class:`Pending`; the caller writes it back with
:meth:`Pending.commit` once the pool holds pages for those positions.

Device. ``build_models(device=...)`` draws the weights on the CPU from the fixed seeds and then
copies them to the device, so a model on the GPU holds the same bits as one on the CPU (and as
one in any other process). Every tensor a forward pass makes (inputs, positions, masks, states,
logits) lives on the model's device; the arena views it reads must be on that device too
(a mismatch fails loudly, nothing moves to the CPU behind the caller's back).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvd.engine.paged import SeqKV
from kvd.pool.layout import GroupKind, GroupSpec, Layout

__all__ = ["TargetConfig", "DraftConfig", "Model", "Models", "Pending", "layout_for", "build_models"]

F64 = torch.float64
KV_DTYPE = torch.float32


@dataclass(frozen=True)
class TargetConfig:
    vocab: int = 256
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    page_size: int = 4
    window: int = 32
    #: layer kinds in order: "swa", "full" (attention) or "state" (linear recurrence)
    layers: tuple[str, ...] = ("swa", "full", "state", "swa", "full")
    state_elems: int = 64
    mlp_hidden: int = 128
    seed: int = 1234


@dataclass(frozen=True)
class DraftConfig:
    vocab: int = 256
    d_model: int = 32
    n_heads: int = 2
    n_kv_heads: int = 1
    head_dim: int = 16
    page_size: int = 8
    layers: tuple[str, ...] = ("draft",)
    mlp_hidden: int = 64
    seed: int = 4321


#: seed of the bigram prior both models share, and how strongly it enters their logits
PRIOR_SEED = 99
PRIOR_GAIN = 8.0


def layout_for(target: TargetConfig, draft: DraftConfig | None, name: str = "tiny-hybrid") -> Layout:
    """The kvd layout of these models' KV: one group per layer kind, float32, the draft's own
    page size. With the default configs it equals the ``tiny-hybrid`` preset byte for byte."""
    count = {k: target.layers.count(k) for k in ("full", "swa", "state")}
    groups = [GroupSpec(kind=GroupKind.FULL, num_layers=count["full"], num_kv_heads=target.n_kv_heads, head_dim=target.head_dim)]
    if count["swa"]:
        groups.append(GroupSpec(kind=GroupKind.SWA, num_layers=count["swa"], num_kv_heads=target.n_kv_heads,
                                head_dim=target.head_dim, window=target.window))
    if count["state"]:
        groups.append(GroupSpec(kind=GroupKind.STATE, num_layers=count["state"], state_elems=target.state_elems))
    if draft is not None:
        groups.append(GroupSpec(kind=GroupKind.DRAFT, num_layers=len(draft.layers), num_kv_heads=draft.n_kv_heads,
                                head_dim=draft.head_dim, page_size=draft.page_size))
    return Layout(name=name, page_size=target.page_size, dtype="float32", groups=tuple(groups),
                  source="kvd.engine.model: the reference engine's target + draft models")


@dataclass
class Pending:
    """KV and state a forward pass produced for positions ``[start, end)``, not yet in the arena.

    ``kv[(group, layer)]`` is ``(k, v)``, float32 ``[positions, kv_heads, head_dim]``;
    ``states[layer]`` is float32 ``[positions, state_elems]`` (the state after each position).
    Successive forward calls append (speculative drafting feeds one token at a time)."""

    start: int
    end: int = -1
    kv: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    states: dict[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.end < 0:
            self.end = self.start

    def add_kv(self, key: tuple[str, int], k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if key in self.kv:
            pk, pv = self.kv[key]
            k, v = torch.cat([pk, k]), torch.cat([pv, v])
        self.kv[key] = (k, v)
        return k, v

    def add_state(self, layer: int, h: torch.Tensor) -> None:
        self.states[layer] = torch.cat([self.states[layer], h]) if layer in self.states else h

    def last_state(self, layer: int) -> torch.Tensor | None:
        s = self.states.get(layer)
        return None if s is None or s.shape[0] == 0 else s[-1]

    def commit(self, seq: SeqKV, upto: int | None = None) -> None:
        """Write positions ``[start, upto)`` (default: all) into the arena through ``seq``, and the
        state after position ``upto - 1``. ``seq`` must hold pages for every one of them."""
        upto = self.end if upto is None else upto
        n = upto - self.start
        if not (0 <= n <= self.end - self.start):
            raise ValueError(f"commit up to {upto}: pending positions are [{self.start}, {self.end})")
        if n == 0:
            return
        for (group, layer), (k, v) in self.kv.items():
            seq.write(group, layer, self.start, k[:n], v[:n])
        for layer, s in self.states.items():
            seq.write_state(layer, s[n - 1])


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class _Rope:
    """Rotary embedding with cached cos/sin tables (grown on demand)."""

    def __init__(self, head_dim: int, device: torch.device) -> None:
        self.half = head_dim // 2
        self.device = device
        self.inv = (10000.0 ** (-torch.arange(self.half, dtype=F64) / self.half)).to(device)
        self.cos = self.sin = torch.empty(0, 1, self.half, dtype=F64, device=device)

    def __call__(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """``x`` ``[T, heads, dim]`` at positions ``start..start+T-1``."""
        end = start + x.shape[0]
        if end > self.cos.shape[0]:
            # element-wise: a position's angle does not depend on how large the table grew
            ang = torch.arange(max(end, 2 * self.cos.shape[0], 1024), dtype=F64, device=self.device)[:, None] * self.inv[None, :]
            self.cos, self.sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        cos, sin = self.cos[start:end], self.sin[start:end]
        x1, x2 = x[..., : self.half], x[..., self.half :]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


@dataclass
class _Attn:
    group: str  # kvd group the layer's KV lives in: full / swa / draft
    index: int  # layer index inside that group
    window: int | None
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor


@dataclass
class _State:
    index: int  # layer index inside the state group
    decay: torch.Tensor
    w_in: torch.Tensor
    w_out: torch.Tensor


class Model:
    """One decoder-only model (target or draft). Stateless: every KV byte lives in the arena or
    in the :class:`Pending` a forward call returns."""

    def __init__(self, cfg: TargetConfig | DraftConfig, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.device = dev = torch.device(device)
        g = torch.Generator().manual_seed(cfg.seed)  # CPU: the same bits on every device and in every process

        def rnd(*shape: int, scale: float) -> torch.Tensor:
            return (torch.randn(*shape, generator=g, dtype=F64) * scale).to(dev)

        d, h, kvh, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.embed = rnd(cfg.vocab, d, scale=1.0)
        self.unembed = rnd(d, cfg.vocab, scale=2.0 / math.sqrt(d))
        self.prior = (torch.randn(cfg.vocab, cfg.vocab, generator=torch.Generator().manual_seed(PRIOR_SEED), dtype=F64) * PRIOR_GAIN).to(dev)
        self.rope = _Rope(hd, dev)
        self.layers: list[_Attn | _State] = []
        seen: dict[str, int] = {}
        for kind in cfg.layers:
            idx = seen.get(kind, 0)
            seen[kind] = idx + 1
            if kind == "state":
                elems = cfg.state_elems  # type: ignore[union-attr]
                decay = (0.5 + 0.49 * torch.rand(elems, generator=g, dtype=F64)).to(dev)
                self.layers.append(_State(idx, decay, rnd(d, elems, scale=1 / math.sqrt(d)), rnd(elems, d, scale=1 / math.sqrt(elems))))
                continue
            window = cfg.window if kind == "swa" else None  # type: ignore[union-attr]
            self.layers.append(_Attn(
                kind, idx, window,
                wq=rnd(d, h * hd, scale=1.5 / math.sqrt(d)), wk=rnd(d, kvh * hd, scale=1.5 / math.sqrt(d)),
                wv=rnd(d, kvh * hd, scale=1 / math.sqrt(d)), wo=rnd(h * hd, d, scale=1.5 / math.sqrt(h * hd)),
                w1=rnd(d, cfg.mlp_hidden, scale=1 / math.sqrt(d)), w2=rnd(cfg.mlp_hidden, d, scale=1 / math.sqrt(cfg.mlp_hidden)),
            ))

    def forward(self, tokens: list[int] | torch.Tensor, start: int, seq: SeqKV, pending: Pending) -> torch.Tensor:
        """Logits (float64 ``[T, vocab]``) for ``tokens`` at positions ``start..start+T-1``.

        Past KV: positions ``[0, pending.start)`` are read from the arena via ``seq`` (only the
        window for sliding-window layers); ``[pending.start, start)`` from ``pending``. The new
        positions' KV and states are appended to ``pending`` (``pending.end`` must be ``start``).
        Nothing is written to the arena here."""
        if pending.end != start:
            raise ValueError(f"forward at position {start}, but pending KV ends at {pending.end}")
        if seq is not None and seq.kv.device != self.device:
            raise ValueError(f"model on {self.device} but its KV arena views are on {seq.kv.device}")
        dev = self.device
        toks = torch.as_tensor(tokens, dtype=torch.int64, device=dev)
        T = toks.numel()
        cfg = self.cfg
        pos = torch.arange(start, start + T, device=dev)
        x = self.embed[toks]
        for layer in self.layers:
            if isinstance(layer, _State):
                h = pending.last_state(layer.index)
                if h is None:  # the state after position pending.start - 1; zero before the first token
                    h = seq.read_state(layer.index) if pending.start else torch.zeros(layer.decay.numel(), device=dev)
                h = h.to(F64)
                u = _rms(x) @ layer.w_in
                out = torch.empty(T, h.numel(), dtype=KV_DTYPE, device=dev)
                for t in range(T):
                    h = (layer.decay * h + u[t]).to(KV_DTYPE).to(F64)  # stored precision, every step
                    out[t] = h
                pending.add_state(layer.index, out)
                x = x + out.to(F64) @ layer.w_out
                continue
            xn = _rms(x)
            q = self.rope((xn @ layer.wq).view(T, cfg.n_heads, cfg.head_dim), start)
            k = self.rope((xn @ layer.wk).view(T, cfg.n_kv_heads, cfg.head_dim), start).to(KV_DTYPE)
            v = (xn @ layer.wv).view(T, cfg.n_kv_heads, cfg.head_dim).to(KV_DTYPE)
            pk, pv = pending.add_kv((layer.group, layer.index), k, v)
            lo = 0 if layer.window is None else max(0, start - layer.window + 1)
            if lo < pending.start:
                ak, av = seq.read(layer.group, layer.index, lo, pending.start)
                keys, vals = torch.cat([ak, pk]), torch.cat([av, pv])
            else:
                skip = lo - pending.start
                keys, vals = pk[skip:], pv[skip:]
            kpos = torch.arange(lo, start + T, device=dev)
            x = x + self._attend(q, keys, vals, pos, kpos, layer.window) @ layer.wo
            x = x + torch.nn.functional.gelu(_rms(x) @ layer.w1) @ layer.w2
        pending.end = start + T
        return _rms(x) @ self.unembed + self.prior[toks]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor,
                window: int | None) -> torch.Tensor:
        """Grouped-query attention: query head ``h`` reads KV head ``h // (heads / kv_heads)``."""
        T = q.shape[0]
        kvh, hd = self.cfg.n_kv_heads, self.cfg.head_dim
        rep = self.cfg.n_heads // kvh
        qg = q.view(T, kvh, rep, hd).permute(1, 2, 0, 3).reshape(kvh, rep * T, hd)
        kg = k.to(F64).permute(1, 2, 0)  # [kvh, hd, S]
        vg = v.to(F64).permute(1, 0, 2)  # [kvh, S, hd]
        scores = torch.bmm(qg, kg) / math.sqrt(hd)  # [kvh, rep * T, S]
        mask = kpos[None, :] <= qpos[:, None]
        if window is not None:
            mask &= kpos[None, :] > qpos[:, None] - window
        scores = scores.masked_fill(~mask.repeat(rep, 1), float("-inf"))
        out = torch.bmm(scores.softmax(-1), vg)  # [kvh, rep * T, hd]
        return out.view(kvh, rep, T, hd).permute(2, 0, 1, 3).reshape(T, kvh * rep * hd)


@dataclass(frozen=True)
class Models:
    """The target and (optionally) its draft, with the layout their KV needs."""

    target: Model
    draft: Model | None
    layout: Layout

    @property
    def device(self) -> torch.device:
        return self.target.device


def build_models(target: TargetConfig | None = None, draft: DraftConfig | None = DraftConfig(), *,
                 device: torch.device | str = "cpu") -> Models:
    """The target and draft with their weights on ``device`` (drawn on the CPU, then copied)."""
    tcfg = target or TargetConfig()
    dev = torch.device(device)
    return Models(Model(tcfg, dev), Model(draft, dev) if draft is not None else None, layout_for(tcfg, draft))
