"""Which layers share a paged KV block: layer groups by attention window.

A model whose layers all attend to the whole context keeps one block table per sequence,
and a block holds every layer's K/V of its tokens. A model that mixes sliding-window and
full layers (Gemma 3: five local layers per global one) would then keep every token's
K/V for the local layers too, long after it left their window. So layers are grouped by
window, each group with its own block table per sequence; a sliding group gives back the
blocks every one of its layers has moved past, while the full group keeps them.

All groups share one pool of block ids. A block holds `slots` layers' K/V; the layers of
a group are laid over a block's slots, so group g's block b is slot s of b for the layer
at (g, s). Groups are made `slots` layers wide, `slots` being the size of the smallest
window class (e.g. Gemma 3 270M, 18 layers, 3 global: 6 groups of 3, one full and five
sliding); a class whose layer count is not a multiple leaves the last group's spare slots
unused.

    groups = KVGroups.of((512, 512, None, 512, 512, None))
    groups.windows       # (None, 512, 512): per group, None = full attention
    groups.layer_group   # (1, 1, 0, 2, 2, 0)
    groups.layer_slot    # (0, 1, 0, 0, 1, 1)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]  # per group: its layers' window, None = full attention
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: which of a block's layer slices it uses
    slots: int  # layers' K/V one block holds

    @classmethod
    def single(cls, num_layers: int, window: int | None = None) -> "KVGroups":
        """Every layer in one group (one block table per sequence)."""
        return cls((window,), (0,) * num_layers, tuple(range(num_layers)), num_layers)

    @classmethod
    def of(cls, layer_windows: tuple[int | None, ...]) -> "KVGroups":
        """Groups for per-layer windows (None: full attention); full attention first."""
        if not layer_windows:
            raise ValueError("a KV cache needs at least one layer.")
        for w in layer_windows:
            if w is not None and (not isinstance(w, int) or w < 1):
                raise ValueError(f"a sliding window must be a positive int or None, got {w!r}.")
        classes: dict[int | None, list[int]] = {}
        for layer, w in enumerate(layer_windows):
            classes.setdefault(w, []).append(layer)
        if len(classes) == 1:
            return cls.single(len(layer_windows), layer_windows[0])
        order = sorted(classes, key=lambda w: (w is not None, w or 0))
        slots = min(len(layers) for layers in classes.values())
        windows: list[int | None] = []
        group = [0] * len(layer_windows)
        slot = [0] * len(layer_windows)
        for w in order:
            layers = classes[w]
            for start in range(0, len(layers), slots):
                for s, layer in enumerate(layers[start:start + slots]):
                    group[layer], slot[layer] = len(windows), s
                windows.append(w)
        return cls(tuple(windows), tuple(group), tuple(slot), slots)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)
