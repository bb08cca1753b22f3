"""KV inspector: pick a cached state and a layer; see shapes, bytes and a
heatmap of key (and value) norms per head and position.

Sources are the ones the engine can export: the last generation, each chat
session's latest checkpoint, and each named checkpoint. Tensors come from
`engine.kv.info(...)` (per-layer metadata) and `engine.kv.export(...)`
(float32 numpy copies). Computing a picture touches MLX through the engine,
so it runs on the thread that built the inspector (the kernel's main thread;
ipywidgets observers run there too); nothing happens on other threads.

The heatmap is a PNG made with numpy + zlib (`_png.py`) shown in an
`ipywidgets.Image`: it renders in JupyterLab without any front-end build.
"""

from __future__ import annotations

import re
import threading

import numpy as np
import ipywidgets as W

from .format import esc, fmt_bytes, fmt_count
from ._png import colorbar_png, heatmap_png

__all__ = ["KVInspector", "norms_per_head", "pick_tensors"]

LAST = "last generation"


def norms_per_head(a: np.ndarray) -> np.ndarray:
    """L2 norm over the feature axis -> (heads, positions).

    Accepts (B, H, T, D) (batch 0 is shown), (H, T, D) or (T, D)."""
    a = np.asarray(a)
    if a.ndim == 4:
        a = a[0]
    if a.ndim == 2:
        a = a[None]
    if a.ndim != 3:
        raise ValueError(f"cannot draw a tensor of shape {a.shape}")
    return np.sqrt(np.sum(np.square(a.astype(np.float64)), axis=-1))


def _layer_of(name: str) -> int | None:
    m = re.search(r"(\d+)", name)
    return int(m.group(1)) if m else None


def _role(name: str) -> str:
    return name.rsplit(".", 1)[-1].lower()


def pick_tensors(arrays: dict, layer: int | None = None, limit: int = 2) -> list[tuple[str, np.ndarray]]:
    """The drawable tensors of one layer: floating arrays, keys before values
    (a quantized cache's packed integers are skipped; its scales are shown)."""
    items = [
        (k, v) for k, v in arrays.items()
        if isinstance(v, np.ndarray) and v.ndim >= 2 and v.size and np.issubdtype(v.dtype, np.floating)
    ]
    if layer is not None:
        mine = [(k, v) for k, v in items if _layer_of(k) == layer]
        if mine:
            items = mine

    def order(kv):
        r = _role(kv[0])
        rank = 0 if r in ("keys", "k") else 1 if r in ("values", "v") else 2 if "key" in r else 3 if "value" in r else 4
        return (rank, kv[0])

    return sorted(items, key=order)[:limit]


class KVInspector(W.VBox):
    """Pick a source (last generation / session / checkpoint) and a layer."""

    def __init__(self, engine, *, max_width: int = 768, **kwargs):
        self.engine = engine
        self.max_width = max_width
        self._owner = threading.current_thread()
        self.source = W.Dropdown(description="state", options=[], layout=W.Layout(width="360px"))
        self.layer = W.Dropdown(description="layer", options=[], layout=W.Layout(width="200px"))
        self.reload = W.Button(description="reload", icon="refresh", layout=W.Layout(width="90px"))
        self.info_html = W.HTML()
        self.caption = W.HTML()
        self.images = W.VBox()
        self.message = W.HTML()
        self.source.add_class("mlxc-kv-source")
        self.layer.add_class("mlxc-kv-layer")
        self.images.add_class("mlxc-kv-images")
        self.info_html.add_class("mlxc-kv-info")
        self.heatmaps: dict[str, bytes] = {}  # tensor name -> PNG bytes, for tests
        self.layer_info: list[dict] = []
        super().__init__(
            children=[W.HBox([self.source, self.layer, self.reload]), self.message, self.info_html, self.caption, self.images],
            **kwargs,
        )
        self.add_class("mlxc-kv-inspector")
        self._busy = False
        self.source.observe(self._on_source, names="value")
        self.layer.observe(self._on_layer, names="value")
        self.reload.on_click(lambda _b: self.refresh_sources())
        self.refresh_sources()

    # --- sources ---

    def sources(self) -> list[tuple[str, dict]]:
        eng = self.engine
        out: list[tuple[str, dict]] = [(LAST, {"last": True})] if eng.last_result is not None else []
        out += [(f"session: {s.id}", {"session": s.id}) for s in eng.sessions.list()]
        out += [(f"checkpoint: {c['name']}", {"checkpoint": c["name"]}) for c in eng.checkpoints.list()]
        return out

    def refresh_sources(self) -> None:
        if threading.current_thread() is not self._owner:
            return
        opts = self.sources()
        current = self.source.value
        self._busy = True
        try:
            self.source.options = [(label, label) for label, _ in opts]
            self._source_args = dict(opts)
            self.source.value = current if current in self._source_args else (opts[0][0] if opts else None)
        finally:
            self._busy = False
        if not opts:
            self._msg("nothing to inspect yet: generate something first")
            self.layer.options = []
            self.info_html.value, self.caption.value, self.images.children = "", "", ()
            return
        self._load_source()

    def select(self, source: str | None = None, layer: int | None = None) -> None:
        """Choose a source (its label, e.g. 'last generation' or 'session: chat') and/or a layer."""
        if source is not None:
            if source not in getattr(self, "_source_args", {}):
                self.refresh_sources()
            self.source.value = source
        if layer is not None:
            self.layer.value = int(layer)

    # --- observers (main thread) ---

    def _on_source(self, change) -> None:
        if not self._busy:
            self._load_source()

    def _on_layer(self, change) -> None:
        if not self._busy:
            self._draw()

    def _msg(self, text: str, error: bool = False) -> None:
        color = "#c62828" if error else "inherit"
        self.message.value = f"<span style='color:{color}'>{esc(text)}</span>" if text else ""

    def _args(self) -> dict | None:
        return getattr(self, "_source_args", {}).get(self.source.value)

    def _load_source(self) -> None:
        args = self._args()
        if args is None:
            return
        try:
            info = list(self.engine.kv.info(**args))
        except Exception as exc:
            self._msg(f"{type(exc).__name__}: {exc}", error=True)
            self.layer_info, self.layer.options = [], []
            self.info_html.value, self.images.children = "", ()
            return
        self._msg("")
        self.layer_info = info
        layers = sorted({int(r.get("layer", i)) for i, r in enumerate(info)})
        keep = self.layer.value
        self._busy = True
        try:
            self.layer.options = [(f"{n}", n) for n in layers]
            self.layer.value = keep if keep in layers else (layers[0] if layers else None)
        finally:
            self._busy = False
        self._draw()

    def _info_table(self, current: int | None) -> str:
        """One row per layer and array (the engine's kv.info rows)."""
        rows = []
        total = 0
        layers = set()
        for r in self.layer_info:
            n = int(r.get("layer", -1))
            layers.add(n)
            total += int(r.get("bytes") or 0)
            shape = r.get("shape", r.get("shapes"))
            if isinstance(shape, dict):
                shape = ", ".join(f"{k} {tuple(v)}" for k, v in shape.items())
            elif isinstance(shape, (list, tuple)):
                shape = str(tuple(shape))
            stats = " ".join(
                f"{k}={r[k]:.3g}" for k in ("mean", "std", "min", "max", "absmax") if isinstance(r.get(k), (int, float))
            )
            cls = " class='mlxc-kv-current'" if n == current else ""
            rows.append(
                f"<tr{cls}><td>{n}</td><td>{esc(r.get('array', ''))}</td><td>{esc(r.get('kind'))}</td>"
                f"<td>{esc(shape)}</td><td>{esc(r.get('dtype'))}</td>"
                f"<td class='num'>{esc(fmt_bytes(r.get('bytes')))}</td><td class='num'>{fmt_count(r.get('offset'))}</td>"
                f"<td>{esc(stats)}</td><td><code>{esc(str(r.get('blake3') or '')[:12])}</code></td></tr>"
            )
        cur = [r for r in self.layer_info if int(r.get("layer", -1)) == current]
        cur_bytes = sum(int(r.get("bytes") or 0) for r in cur)
        return (
            "<style>.mlxc-kv-info td,.mlxc-kv-info th{padding:1px 6px;font-size:12px;white-space:nowrap;text-align:left}"
            ".mlxc-kv-info td.num{text-align:right}.mlxc-kv-info tr.mlxc-kv-current{background:var(--jp-layout-color2,#eef)}"
            ".mlxc-kv-info .mlxc-kv-scroll{max-height:16em;overflow:auto}</style>"
            f"<div><b>{len(layers)} layers, {esc(fmt_bytes(total))}</b>"
            + (f" · layer {current}: {esc(fmt_bytes(cur_bytes))}" if cur else "")
            + "</div><div class='mlxc-kv-scroll'><table>"
            "<tr><th>layer</th><th>array</th><th>kind</th><th>shape</th><th>dtype</th><th>bytes</th><th>offset</th>"
            "<th>stats</th><th>blake3</th></tr>" + "".join(rows) + "</table></div>"
        )

    def _draw(self) -> None:
        if threading.current_thread() is not self._owner:
            return
        args, layer = self._args(), self.layer.value
        self.info_html.value = self._info_table(layer)
        if args is None or layer is None:
            return
        try:
            arrays = self.engine.kv.export(**args, layer=layer)
            tensors = pick_tensors(dict(arrays), layer)
            if not tensors:
                raise ValueError(f"layer {layer} has no tensor to draw")
            images, heatmaps, captions = [], {}, []
            for name, a in tensors:
                norms = norms_per_head(a)
                png, meta = heatmap_png(norms, max_width=self.max_width, gap=1)
                heatmaps[name] = png
                label = W.HTML(
                    f"<b>{esc(name)}</b> {esc(tuple(a.shape))} — L2 norm per head (rows, 0 at top) and position "
                    f"(columns{', ' + str(meta['col_bin']) + ' positions per pixel' if meta['col_bin'] > 1 else ''}); "
                    f"{meta['vmin']:.3g} <img src='data:image/png;base64,{_b64(colorbar_png())}' "
                    f"style='vertical-align:middle'/> {meta['vmax']:.3g}"
                )
                img = W.Image(value=png, format="png", layout=W.Layout(width=f"{meta['width']}px", height=f"{meta['height']}px"))
                img.add_class("mlxc-kv-heatmap")
                images += [label, img]
                captions.append(name)
        except Exception as exc:
            self._msg(f"{type(exc).__name__}: {exc}", error=True)
            self.images.children = ()
            return
        self._msg("")
        self.heatmaps = heatmaps
        self.caption.value = f"<i>{esc(self.source.value)}, layer {layer}</i>"
        old = self.images.children
        self.images.children = tuple(images)
        for w in old:
            w.close()

    def close(self) -> None:
        if threading.current_thread() is self._owner:
            for w in list(self.images.children):
                w.close()
        super().close()


def _b64(b: bytes) -> str:
    import base64

    return base64.b64encode(b).decode("ascii")
