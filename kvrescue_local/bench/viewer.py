"""A self-contained HTML page (inline CSS and JS, no network) showing one trajectory record.

Input: a Trajectory (kvrescue_local/rescue/record.py), as written by `kvrescue-local solve --json`. The page shows
the problem, the committed trajectory with every step coloured by the model that wrote it (base or
helper) and its PRM score, each round's candidates in an expandable table (side, tokens, how it
ended, PRM score, detector statistics; killed candidates struck through in red, the committed one
starred), the final answer and a cost summary.

Everything is rendered here with escaping, so the page reads fine without JavaScript; the script only
adds expand/collapse controls (`#all` in the URL opens every round) and marks
`<body data-viewer="ready">` once it has run. Control, zero-width and bidi-override characters in
candidate text are shown as visible marks (\\x08, <U+202E>): a random-weight model emits any byte. A
Content-Security-Policy allows no network access and no script but the page's own (by its hash).
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import re
from pathlib import Path

from ..errors import KVRescueError
from ..files import check_input_file, write_output
from ..rescue.record import SIDES, Step, Trajectory

_INVISIBLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff\ud800-\udfff]")


def _visible(match: re.Match) -> str:
    c = match.group(0)
    code = ord(c)
    if 0xD800 <= code <= 0xDFFF:
        return '<span class="ctl" title="lone surrogate">\ufffd</span>'
    if code < 0x100:
        glyph = f"\\x{code:02x}"
    else:
        glyph = f"&lt;U+{code:04X}&gt;"
    return f'<span class="ctl" title="U+{code:04X}">{glyph}</span>'


def esc(text) -> str:
    """HTML-escaped text with control, zero-width and bidi-override characters made visible."""
    return _INVISIBLE.sub(_visible, html.escape(str(text), quote=True))


def attr(text) -> str:
    """Escaped for an attribute value (no markup inside)."""
    return html.escape(_INVISIBLE.sub(lambda m: f"U+{ord(m.group(0)):04X}", str(text)), quote=True)


def fmt_score(score) -> str:
    if not isinstance(score, (int, float)) or isinstance(score, bool):
        return "-"
    if score != 0 and abs(score) < 1e-3:
        return f"{score:.1e}"
    return f"{score:.3f}"


def flat_config(config: dict) -> dict:
    """Trajectory records nest kv and detector settings; results lines are flat: accept both."""
    config = config if isinstance(config, dict) else {}
    flat = {k: v for k, v in config.items() if not isinstance(v, dict)}
    for nested in ("kv", "detector"):
        if isinstance(config.get(nested), dict):
            flat = {**config[nested], **flat}
    return flat


def load_trajectory(path: str | Path) -> Trajectory:
    path = Path(path)
    if path.exists():  # a device or FIFO would be read endlessly
        check_input_file(path, "--html")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise KVRescueError(f"trajectory file not found: {path}; write one with `kvrescue-local solve ... --json FILE`") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise KVRescueError(f"{path} is not JSON: pass the file written by `kvrescue-local solve --json`") from None
    except OSError as exc:
        raise KVRescueError(f"cannot read {path} ({exc.strerror}): check the path and its permissions") from None
    return Trajectory.from_json(data, str(path))


CSS = """
:root { --base: #1f6fb2; --base-bg: #e7f0fa; --helper: #c26d00; --helper-bg: #fdf0df; --killed: #c0392b;
        --killed-bg: #fbe9e7; --ink: #1d232a; --muted: #5f6b76; --line: #d5dbe1; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--ink); margin: 0 auto;
       max-width: 1100px; padding: 18px 22px 60px; background: #fff; }
h1 { font-size: 20px; margin: 0 0 10px; } h2 { font-size: 16px; margin: 22px 0 8px; }
pre { white-space: pre-wrap; word-break: break-word; margin: 0; font: 13px/1.4 ui-monospace, Menlo, Consolas, monospace; }
.problem { background: #f4f6f8; border: 1px solid var(--line); border-radius: 6px; padding: 10px 12px; }
.cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(200px, 1fr)); gap: 8px; }
.card { border: 1px solid var(--line); border-radius: 6px; padding: 8px 10px; }
.card b { display: block; font-size: 11px; text-transform: uppercase; letter-spacing: .04em; color: var(--muted); }
.answer { font-size: 18px; font-weight: 600; }
.legend span { display: inline-block; margin-right: 14px; }
.sw { display: inline-block; width: 12px; height: 12px; border-radius: 2px; vertical-align: -1px; margin-right: 4px; }
.sw.base { background: var(--base); } .sw.helper { background: var(--helper); } .sw.killed { background: var(--killed); }
.overview { border: 1px solid var(--line); border-radius: 6px; padding: 10px 12px; }
.overview a { color: inherit; text-decoration: none; border-radius: 3px; padding: 0 1px; }
.overview a.base { background: var(--base-bg); border-bottom: 2px solid var(--base); }
.overview a.helper { background: var(--helper-bg); border-bottom: 2px solid var(--helper); }
.step { border: 1px solid var(--line); border-left: 6px solid var(--line); border-radius: 6px; margin: 10px 0;
        padding: 8px 12px; }
.step.base { border-left-color: var(--base); } .step.helper { border-left-color: var(--helper); }
.step.base > pre { background: var(--base-bg); } .step.helper > pre { background: var(--helper-bg); }
.step > pre { padding: 6px 8px; border-radius: 4px; }
.head { display: flex; gap: 12px; align-items: baseline; flex-wrap: wrap; margin-bottom: 6px; }
.badge { color: #fff; border-radius: 10px; padding: 0 8px; font-size: 12px; font-weight: 600; }
.badge.base { background: var(--base); } .badge.helper { background: var(--helper); }
.badge.killed { background: var(--killed); }
.muted { color: var(--muted); font-size: 12px; }
details { margin-top: 6px; } summary { cursor: pointer; color: var(--muted); font-size: 12px; }
table { border-collapse: collapse; width: 100%; margin-top: 4px; font-size: 12px; }
th, td { border-bottom: 1px solid var(--line); padding: 3px 6px; text-align: left; vertical-align: top; }
td:first-child { white-space: nowrap; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr.killed td { background: var(--killed-bg); }
tr.killed td.text pre { text-decoration: line-through; text-decoration-color: var(--killed); color: #7a2b22; }
tr.winner td { font-weight: 600; }
td.text pre { max-height: 8.5em; overflow: auto; font-size: 12px; }
.ctl { color: #9a3ebf; background: #f3e8f9; border-radius: 2px; font-size: 11px; }
.kill { color: var(--killed); font-weight: 700; }
#controls button { font: inherit; font-size: 12px; margin-right: 6px; padding: 2px 10px; cursor: pointer; }
"""

JS = """
(function () {
  "use strict";
  var body = document.body;
  var boxes = Array.prototype.slice.call(document.querySelectorAll("details.cands"));
  function setAll(open) { boxes.forEach(function (d) { d.open = open; }); }
  document.getElementById("expand").addEventListener("click", function () { setAll(true); });
  document.getElementById("collapse").addEventListener("click", function () { setAll(false); });
  document.getElementById("killed").addEventListener("click", function () {
    boxes.forEach(function (d) { d.open = d.querySelector("tr.killed") !== null; });
  });
  document.addEventListener("keydown", function (e) {
    if (e.target && /INPUT|TEXTAREA/.test(e.target.tagName)) return;
    if (e.key === "e") setAll(true);
    if (e.key === "c") setAll(false);
  });
  if (location.hash === "#all") setAll(true);
  var killed = document.querySelectorAll("tr.killed").length;
  var steps = document.querySelectorAll("section.step").length;
  document.getElementById("controls").hidden = false;
  body.setAttribute("data-rendered", steps + " steps, " + killed + " killed");
  body.setAttribute("data-viewer", "ready");
})();
"""


def _winner_index(step: Step) -> int | None:
    for i, c in enumerate(step.candidates):
        if c.side == step.source and c.text == step.text and c.score == step.score and not c.killed:
            return i
    for i, c in enumerate(step.candidates):
        if c.side == step.source and c.text == step.text:
            return i
    return None


def _side(value) -> str:
    return value if value in SIDES else "other"


def _candidates_table(step: Step) -> str:
    winner = _winner_index(step)
    rows = []
    for i, c in enumerate(step.candidates):
        det = c.detector or {}
        cls = " ".join(x for x in ("killed" if c.killed else "", "winner" if i == winner else "") if x)
        reason = esc(det.get("killed") or "detector")
        how = f'<span class="kill">killed: {reason}</span>' if c.killed else esc(c.finished or "-")
        mark = "&#9733; " if i == winner else ""
        entropy = fmt_score(det.get("max_mean_entropy")) if det else "-"
        ratio = fmt_score(det.get("min_compression")) if det else "-"
        rows.append(
            f'<tr class="{cls}"><td>{mark}<span class="badge {_side(c.side)}">{esc(c.side)}</span>'
            f' {esc(c.index)}</td><td class="num">{esc(c.tokens)}</td><td>{how}</td>'
            f'<td class="num">{fmt_score(c.score)}</td><td class="num">{entropy}</td>'
            f'<td class="num">{ratio}</td><td class="text"><pre>{esc(c.text)}</pre></td></tr>')
    summary = f"{len(step.candidates)} candidates" + (f', <span class="kill">{step.killed} killed</span>'
                                                      if step.killed else "")
    return (f'<details class="cands"><summary>{summary}</summary><table><thead><tr><th>candidate</th>'
            '<th>tokens</th><th>ended</th><th>PRM</th><th>max mean entropy</th><th>min compression</th><th>text</th>'
            f'</tr></thead><tbody>{"".join(rows)}</tbody></table></details>')


def _card(label: str, value: str) -> str:
    return f'<div class="card"><b>{esc(label)}</b>{value}</div>'


def render_html(trajectory: Trajectory | dict) -> str:
    """The page for one trajectory (a record dict is read through Trajectory.from_json)."""
    traj = trajectory if isinstance(trajectory, Trajectory) else Trajectory.from_json(trajectory)
    steps = traj.steps
    cfg = flat_config(traj.config)
    base_cands = traj.base_candidates
    sources = traj.steps_from()
    mode = traj.mode

    answer_html = (f'<span class="answer">{esc(traj.answer)}</span>' if traj.answer is not None
                   else '<span class="muted">none</span>')
    setting = f"{esc(cfg.get('mode', '?'))}, N={esc(cfg.get('n', '?'))}"
    if mode is not None and mode.evicts:
        setting += (f"<div class=\"muted\">budget {esc(cfg.get('budget', '?'))} + buffer {esc(cfg.get('buffer', '?'))}, "
                    f"{esc(cfg.get('policy', '?'))}</div>")
    if mode is not None and mode.detects:
        setting += (f"<div class=\"muted\">&tau;<sub>ent</sub> {esc(cfg.get('tau_entropy', '?'))}, "
                    f"&tau;<sub>cmp</sub> {esc(cfg.get('tau_compression', '?'))}</div>")
    timing_parts = [f"{k.replace('llama_', 'llama.cpp ')} {float(v):.3f} s" for k, v in traj.timings.items()
                    if isinstance(v, (int, float)) and k != "total"]
    total = traj.timings.get("total")
    cells = [c.get("max_candidate") for c in traj.base_cells]
    cells = [c for c in cells if isinstance(c, (int, float))]
    tokens = traj.tokens
    cards = [
        _card("answer", answer_html),
        _card("stop", esc(traj.stop or "-")),
        _card("mode", setting),
        _card("committed steps", f"{len(steps)}<div class=\"muted\">base {sources['base']}, helper {sources['helper']}</div>"),
        _card("tokens generated", f"base {esc(tokens.get('base', 0))}, helper {esc(tokens.get('helper', 0))}"
                                  f"<div class=\"muted\">committed {esc(tokens.get('committed', 0))}</div>"),
        _card("early exits", f"{traj.killed} of {len(base_cands)} base candidates"
                             + (f" ({100.0 * traj.early_exit_fraction:.1f}%)" if base_cands else "")),
        _card("time", (f"{float(total):.3f} s" if isinstance(total, (int, float)) else "-")
              + f"<div class=\"muted\">{esc(', '.join(timing_parts))}</div>"),
    ]
    if cells:
        cards.append(_card("base KV cells", f"peak {int(max(cells))} per candidate"))

    links = []
    for i, s in enumerate(steps):
        tip = attr(f"step {i + 1}, {s.source}, PRM {fmt_score(s.score)}")
        links.append(f'<a class="{_side(s.source)}" href="#step-{i + 1}" title="{tip}">{esc(s.text)}</a>')
    overview = "".join(links)
    sections = []
    for i, s in enumerate(steps):
        side = _side(s.source)
        winner = _winner_index(s)
        n_tokens = s.candidates[winner].tokens if winner is not None else None
        sections.append(
            f'<section class="step {side}" id="step-{i + 1}"><div class="head"><b>step {i + 1}</b>'
            f'<span class="badge {side}">{esc(s.source)}</span>'
            f'<span>PRM {fmt_score(s.score)}</span>'
            f'<span class="muted">round {esc(s.round)}, ended by {esc(s.finished or "-")}'
            + (f", {esc(n_tokens)} tokens" if n_tokens is not None else "") + '</span></div>'
            f'<pre>{esc(s.text)}</pre>{_candidates_table(s)}</section>')

    script_hash = base64.b64encode(hashlib.sha256(JS.encode()).digest()).decode()
    csp = f"default-src 'none'; style-src 'unsafe-inline'; script-src 'sha256-{script_hash}'"
    problem = traj.problem
    title = problem if len(problem) <= 70 else problem[:67] + "..."
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{attr(csp)}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>KV-Rescue trajectory: {esc(title)}</title>
<style>{CSS}</style>
</head>
<body data-viewer="static">
<h1>KV-Rescue trajectory</h1>
<pre class="problem">{esc(problem)}</pre>
<h2>Result and cost</h2>
<div class="cards">{"".join(cards)}</div>
<h2>Committed trajectory</h2>
<p class="legend"><span><i class="sw base"></i>base (evicted KV)</span><span><i class="sw helper"></i>helper (full KV)</span>
<span><i class="sw killed"></i>killed by the detector</span></p>
<pre class="overview">{overview or '<span class="muted">no steps</span>'}</pre>
<h2>Rounds</h2>
<p id="controls" hidden><button id="expand" type="button">expand all</button><button id="collapse" type="button">collapse all</button><button id="killed" type="button">open rounds with kills</button><span class="muted">keys: e / c</span></p>
{"".join(sections)}
<script>{JS}</script>
</body>
</html>
"""


def write_html(trajectory: Trajectory | dict, out: str | Path) -> Path:
    out = Path(out)
    if out.is_dir():
        raise KVRescueError(f"{out} is a directory: pass a file name for the page, e.g. {out / 'trajectory.html'}")
    return write_output(out, render_html(trajectory).encode("utf-8", "replace"), "--out")
