"""The standalone HTML page of a `focus-hf inspect` report (`focus_hf.interpret.report.inspect_groups`).

One view per layer: the first block's tokens coloured by their group, and the layer's group table (token share
as a bar against the balanced share 1/K, confidence, dominant category, purity, frequent tokens). Beside it, a
layers x groups balance heatmap that doubles as a layer switcher. Everything is inline (CSS, a few lines of
script, no fonts or CDN), so the page works offline and from `file://`; without JavaScript all layers are shown.
`#layer-N` in the address opens layer N (the views' element ids differ, so the page does not scroll to it).
"""

from __future__ import annotations

import html

# Light, mutually distinct backgrounds under black text (ColorBrewer Set3-like) for the first groups; more groups
# step the hue by the golden angle so that neighbouring group numbers never get similar colours.
_PALETTE = ("#8dd3c7", "#ffe680", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5",
            "#bc80bd", "#ccebc5", "#d9b38c", "#9fd6f0")  # fmt: skip
_BLUE, _RED = (33, 102, 172), (178, 24, 43)  # the ends of the balance scale (RdBu), as in the PNG chart


def group_colour(group: int) -> str:
    """The CSS background colour of `group` on the page."""
    if group < len(_PALETTE):
        return _PALETTE[group]
    return f"hsl({round(group * 137.508) % 360}, 65%, 78%)"


def _balance_colour(ratio: float, top: float) -> str:
    """White at a balanced share (ratio share/(1/K) = 1), blue towards an empty group, red towards `top`."""
    if ratio <= 1:
        end, weight = _BLUE, 1 - max(ratio, 0.0)
    else:
        end, weight = _RED, min((ratio - 1) / max(top - 1, 1e-9), 1.0)
    channels = (round(255 + (c - 255) * weight) for c in end)
    return "#" + "".join(f"{c:02x}" for c in channels)


def _group_rows(layer: dict, scale: float) -> str:
    balanced = 1 / max(layer["num_groups"], 1)
    rows = []
    for g in layer["groups"]:
        bar = (f'<span class="bar"><span class="fill" style="width:{100 * g["share"] / scale:.1f}%"></span>'
               f'<span class="even" style="left:{100 * balanced / scale:.1f}%"></span></span>')  # fmt: skip
        confidence = "" if g["mean_confidence"] is None else format(g["mean_confidence"], ".2f")
        purity = "" if g["purity"] is None else format(g["purity"], ".0%")
        tokens = html.escape(" ".join(repr(t) for t, _ in g["top_tokens"][:8]))
        rows.append(
            f'<tr><td class="g{g["group"]}">{g["group"]}</td><td class="share">{bar}{g["share"]:.1%}</td>'
            f"<td>{confidence}</td><td>{html.escape(str(g['dominant_category'] or ''))}</td><td>{purity}</td>"
            f'<td class="tokens">{tokens}</td></tr>'
        )
    return "".join(rows)


def _heatmap(layers: list[dict], max_groups: int) -> str:
    ratios = [g["share"] * layer["num_groups"] for layer in layers for g in layer["groups"]]
    top = max([2.0, *ratios])
    head = "".join(f"<th>{g}</th>" for g in range(max_groups))
    rows = []
    for layer in layers:
        cells = "".join(
            f'<td style="background:{_balance_colour(g["share"] * layer["num_groups"], top)}" '
            f'title="layer {layer["layer"]}, group {g["group"]}: {g["share"]:.1%} of tokens"></td>'
            for g in layer["groups"]
        )
        cells += "<td></td>" * (max_groups - len(layer["groups"]))
        rows.append(f'<tr data-layer="{layer["layer"]}"><th>{layer["layer"]}</th>{cells}</tr>')
    return (f'<table class="heat"><tr><th>layer</th>{head}</tr>{"".join(rows)}</table>'
            f'<div class="scale"></div><div class="scale-labels"><span>empty</span><span>1/K</span>'
            f"<span>{top:.1f}/K</span></div>")  # fmt: skip


def render_html(report: dict, title: str = "Focus groups") -> str:
    """A standalone, offline HTML page of an `inspect_groups` report (with its "_first_block" entry).

    Per layer: the first block's tokens coloured by group and the layer's group table; a balance heatmap of all
    layers (click a row to show that layer), a layer select with previous/next buttons and arrow keys.
    """
    first = report["_first_block"]
    layers = report["layers"]
    max_groups = max((layer["num_groups"] for layer in layers), default=1)
    # One bar scale for every layer, so that bars compare across layers; at least twice the balanced share.
    scale = max([2 / max(max_groups, 1), *(g["share"] for layer in layers for g in layer["groups"])])
    group_css = "\n".join(f".g{g} {{ background: {group_colour(g)}; }}" for g in range(max_groups))
    views = []
    for layer in layers:
        spans = "".join(
            f'<span class="t g{g}" title="group {g}">{html.escape(text)}</span>'
            for text, g in zip(first["tokens"], first["groups"][layer["layer"]])
        )
        views.append(
            f'<section class="layer" id="view-{layer["layer"]}"><h2>Layer {layer["layer"]}</h2>'
            f'<p class="meta">mean confidence {layer["mean_confidence"]:.2f}; {layer["num_groups"]} groups, '
            f"balanced share 1/K = {1 / max(layer['num_groups'], 1):.1%} (dashed line)</p>"
            f'<table class="groups"><tr><th>group</th><th>share of tokens</th><th>confidence</th>'
            f"<th>dominant category</th><th>purity</th><th>frequent tokens</th></tr>{_group_rows(layer, scale)}</table>"
            f'<pre class="text">{spans}</pre></section>'
        )
    options = "".join(f'<option value="{layer["layer"]}">layer {layer["layer"]}</option>' for layer in layers)
    blue, red = ("#" + "".join(f"{c:02x}" for c in end) for end in (_BLUE, _RED))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em 2em; color: #222; }}
h1 {{ font-size: 1.5em; margin: 0 0 0.3em; overflow-wrap: anywhere; }}
h2 {{ font-size: 1.15em; margin: 0.6em 0 0.2em; }}
.summary {{ max-width: 75em; }} .meta {{ color: #555; margin: 0 0 0.5em; font-size: 13px; }}
.columns {{ display: flex; gap: 2em; align-items: flex-start; }} .view {{ flex: 1; min-width: 0; }}
.overview {{ flex: none; position: sticky; top: 1em; font-size: 12px; }}
.switch {{ display: flex; gap: 0.5em; align-items: center; }} .switch .hint {{ color: #777; font-size: 12px; }}
pre.text {{ white-space: pre-wrap; overflow-wrap: anywhere; line-height: 1.7; font-size: 14px;
  border-top: 1px solid #ddd; padding-top: 0.5em; }}
span.t {{ border-radius: 3px; }}
{group_css}
table {{ border-collapse: collapse; }}
table.groups td, table.groups th {{ border: 1px solid #ccc; padding: 2px 8px; font-size: 13px; text-align: left; }}
table.groups td.tokens {{ font-family: monospace; font-size: 12px; }}
td.share {{ white-space: nowrap; }}
.bar {{ display: inline-block; position: relative; width: 90px; height: 10px; background: #eee; margin-right: 6px;
  vertical-align: middle; }}
.bar .fill {{ position: absolute; left: 0; top: 0; bottom: 0; background: #b2182b; }}
.bar .even {{ position: absolute; top: -2px; bottom: -2px; border-left: 2px dashed #000; }}
table.heat th {{ font-weight: normal; color: #555; padding: 0 4px; }}
table.heat td {{ width: 22px; height: 13px; border: 1px solid #fff; }}
table.heat tr[data-layer] {{ cursor: pointer; }} table.heat tr.current th {{ color: #000; font-weight: bold; }}
table.heat tr.current td {{ box-shadow: inset 0 2px #000, inset 0 -2px #000; }}
.scale {{ height: 10px; margin-top: 6px; background: linear-gradient(to right, {blue}, #fff 50%, {red});
  border: 1px solid #ccc; }}
.scale-labels {{ display: flex; justify-content: space-between; color: #555; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p class="summary">{html.escape(report["summary"])}</p>
<div class="columns">
<div class="view">
<div class="switch"><button type="button" id="prev" title="previous layer">&#9664;</button>
<label>Layer <select id="layer-switch">{options}</select></label>
<button type="button" id="next" title="next layer">&#9654;</button>
<span class="hint">arrow keys or a click on the balance chart switch layers; hover a token for its group</span></div>
{"".join(views)}
</div>
<aside class="overview"><h2>Group balance</h2>
<p class="meta">share of tokens per layer and group<br>(white: 1/K, balanced)</p>
{_heatmap(layers, max_groups)}
</aside>
</div>
<script>
(function () {{
  var select = document.getElementById("layer-switch");
  function show(layer) {{
    if (!document.getElementById("view-" + layer)) return;
    select.value = String(layer);
    document.querySelectorAll("section.layer").forEach(function (s) {{ s.hidden = s.id !== "view-" + layer; }});
    document.querySelectorAll("table.heat tr[data-layer]").forEach(function (r) {{
      r.classList.toggle("current", r.getAttribute("data-layer") === String(layer));
    }});
  }}
  function step(delta) {{
    var i = Math.min(Math.max(select.selectedIndex + delta, 0), select.options.length - 1);
    show(select.options[i].value);
  }}
  select.addEventListener("change", function () {{ show(select.value); }});
  document.getElementById("prev").addEventListener("click", function () {{ step(-1); }});
  document.getElementById("next").addEventListener("click", function () {{ step(1); }});
  document.addEventListener("keydown", function (e) {{
    if (e.target === select) return;  // the select handles its own arrow keys
    if (e.key === "ArrowLeft") step(-1); else if (e.key === "ArrowRight") step(1);
  }});
  document.querySelectorAll("table.heat tr[data-layer]").forEach(function (r) {{
    r.addEventListener("click", function () {{ show(r.getAttribute("data-layer")); }});
  }});
  window.addEventListener("hashchange", function () {{ show(location.hash.replace("#layer-", "")); }});
  var wanted = location.hash.indexOf("#layer-") === 0 ? location.hash.slice(7) : null;
  show(wanted !== null && document.getElementById("view-" + wanted) ? wanted : select.value);
}})();
</script>
</body></html>
"""
