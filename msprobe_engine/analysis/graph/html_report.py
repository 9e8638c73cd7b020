"""One self-contained HTML file of the graphs: no server, no network (the data is embedded).

It shows, per graph (step, rank): the first divergence or the incident's culprit with its
path from the root, notes (no construct.json...), the structure difference of a comparison,
the hierarchy as a collapsible tree coloured by precision class, a search over node names,
and each node's tensors with their diff. ``#search=<text>`` in the URL searches on load,
``#node=<name>`` opens a node.
"""
from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from msprobe_engine.analysis.graph.model import Graph, Node

if TYPE_CHECKING:
    from msprobe_engine.analysis.graph.graph_set import GraphSet


def _node(node: Node) -> dict[str, Any]:
    marks = (("first-divergence", node.first_divergence), ("contains-divergence", node.contains_divergence),
             ("culprit", node.culprit), ("contains-culprit", node.contains_culprit))
    flags = [name for name, on in marks if on]
    return {"p": node.parent, "c": node.children, "cls": node.class_name, "flags": flags, "ov": node.overflow,
            "m": node.matched, "r": node.reason, "in": node.inputs, "out": node.outputs}


def _graph(graph: Graph, structure: dict[str, Any] | None, reference: str | None) -> dict[str, Any]:
    return {"label": graph.label, "source": graph.source, "reference": reference, "root": graph.root,
            "first": graph.first_divergence, "culprit": graph.culprit, "notes": graph.notes,
            "structure": structure, "nodes": {n.name: _node(n) for n in graph.nodes.values()}}


def _json_safe(value: Any) -> Any:
    """`value` with nan/inf floats as the strings ``nan``/``inf``/``-inf`` (JSON has no such numbers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if value != value else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def report_data(result: GraphSet) -> dict[str, Any]:
    graphs = [_graph(g, result.structures[i].as_dict() if result.compared else None,
                     result.references[i].source if result.compared else None)
              for i, g in enumerate(result.targets)]
    return {"mode": result.mode if result.compared else "build", "graphs": graphs, "problems": result.problems}


def write_html(path: Path, result: GraphSet) -> Path:
    """Write the report of `result` to `path`."""
    data = json.dumps(_json_safe(report_data(result)), default=str, allow_nan=False).replace("</", "<\\/")
    title = "msprobe-engine graph: " + ("comparison" if result.compared else "build")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_PAGE.replace("{{title}}", html.escape(title)).replace("{{data}}", data), encoding="utf-8")
    return path


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{{title}}</title>
<style>
body{font:14px system-ui,sans-serif;margin:0;display:flex;flex-direction:column;height:100vh}
header{padding:8px 12px;background:#24292f;color:#fff;display:flex;gap:12px;align-items:center}
header input{width:320px;padding:4px} main{flex:1;display:flex;min-height:0}
#tree{flex:1;overflow:auto;padding:8px} #detail{width:44%;overflow:auto;padding:8px;border-left:1px solid #ccc}
#banner>div,#banner>details{padding:6px 12px;border-bottom:1px solid #ddd} .note{background:#fff8c5} .div{background:#ffd7cc}
ul{list-style:none;margin:0;padding-left:18px} summary,.leaf{cursor:pointer;padding:1px 4px;border-radius:3px}
.pass>summary,.pass>.leaf{background:#FFFCF3} .warning>summary,.warning>.leaf{background:#FFDC7F}
.error>summary,.error>.leaf{background:#FF704D} .unmatched>summary,.unmatched>.leaf{background:#C7C7C7}
.first-divergence>summary,.first-divergence>.leaf,.culprit>summary,.culprit>.leaf{outline:3px solid #b00020}
.contains-divergence>summary,.contains-culprit>summary{border-left:4px solid #b00020}
.hit>summary,.hit>.leaf{box-shadow:0 0 0 2px #0969da} .tag{font-size:11px;padding:0 4px;margin-left:6px;border-radius:3px;background:#eee}
table{border-collapse:collapse;font-size:12px} td,th{border:1px solid #ddd;padding:2px 4px;text-align:left}
#results li{cursor:pointer;color:#0969da}
</style></head><body>
<header><b>{{title}}</b><select id="which"></select>
<input id="search" placeholder="search node names (substring)"><span id="count"></span></header>
<div id="banner"></div>
<main><div id="tree"></div><div id="detail"><ul id="results"></ul><div id="info">Click a node.</div></div></main>
<script id="data" type="application/json">{{data}}</script>
<script>
const DATA = JSON.parse(document.getElementById('data').textContent);
let G = null, items = {};
const el = (tag, attrs, text) => { const e = document.createElement(tag);
  for (const k in attrs || {}) e.setAttribute(k, attrs[k]); if (text !== undefined) e.textContent = text; return e; };
function label(name, n) {
  const s = el('span', {}, name);
  if (n.flags.includes('first-divergence')) s.append(el('span', {class: 'tag'}, 'first divergence'));
  if (n.flags.includes('culprit')) s.append(el('span', {class: 'tag'}, 'culprit'));
  if (n.flags.includes('contains-divergence') || n.flags.includes('contains-culprit'))
    s.append(el('span', {class: 'tag'}, 'contains it'));
  if (n.ov) s.append(el('span', {class: 'tag'}, 'overflow: ' + n.ov));
  if (n.cls === 'unmatched') s.append(el('span', {class: 'tag'}, 'unmatched'));
  return s;
}
function renderNode(name) {
  const n = G.nodes[name], li = el('li', {class: [n.cls, ...n.flags].join(' '), 'data-node': name});
  items[name] = li;
  if (n.c.length) {
    const d = el('details'), s = el('summary'); s.append(label(name, n)); d.append(s);
    s.addEventListener('click', () => show(name));
    const ul = el('ul'); n.c.forEach(c => ul.append(renderNode(c))); d.append(ul); li.append(d);
    li.classList.add(...[n.cls, ...n.flags]);
  } else { const s = el('span', {class: 'leaf'}); s.append(label(name, n)); s.onclick = () => show(name); li.append(s); }
  return li;
}
function fixClasses() { for (const name in items) { const li = items[name], d = li.querySelector(':scope>details');
  if (d) { d.className = li.className; } } }
function reveal(name) { let p = G.nodes[name].p; while (p) { const d = items[p].querySelector(':scope>details');
  if (d) d.open = true; p = G.nodes[p].p; } }
function table(title, recs) {
  const keys = Object.keys(recs); if (!keys.length) return el('div');
  const cols = [...new Set(keys.flatMap(k => Object.keys(recs[k])))];
  const t = el('table'), h = el('tr'); h.append(el('th', {}, title)); cols.forEach(c => h.append(el('th', {}, c))); t.append(h);
  keys.forEach(k => { const r = el('tr'); r.append(el('td', {}, k));
    cols.forEach(c => { const v = recs[k][c];
      r.append(el('td', {}, v === undefined ? '' : typeof v === 'string' ? v : JSON.stringify(v))); }); t.append(r); });
  return t;
}
function show(name) {
  const n = G.nodes[name], info = document.getElementById('info'); info.replaceChildren();
  info.setAttribute('data-node', name);
  info.append(el('h3', {}, name), el('div', {}, 'class: ' + n.cls + (n.m ? '; matched: ' + n.m : '') +
    (n.ov ? '; overflow: ' + n.ov : '') + (n.r && n.r !== 'unmatched' ? '; ' + n.r : '')),
    table('inputs', n.in), table('outputs', n.out));
  reveal(name);
}
function search(text) {
  const res = document.getElementById('results'); res.replaceChildren();
  Object.values(items).forEach(li => li.classList.remove('hit'));
  if (!text) { document.getElementById('count').textContent = ''; return; }
  const hits = Object.keys(G.nodes).filter(n => n.toLowerCase().includes(text.toLowerCase()));
  document.getElementById('count').textContent = hits.length + ' found';
  hits.slice(0, 200).forEach(n => { items[n].classList.add('hit'); reveal(n);
    const li = el('li', {'data-node': n}, n); li.onclick = () => show(n); res.append(li); });
  fixClasses();
}
function banner() {
  const b = document.getElementById('banner'); b.replaceChildren();
  const path = n => [...anc(n), n].join(' > ');
  if (G.first) { const d = el('div', {id: 'first-divergence', class: 'div', 'data-node': G.first},
    'First divergence: ' + path(G.first) + (G.nodes[G.first].r ? ' (' + G.nodes[G.first].r + ')' : ''));
    d.onclick = () => show(G.first); b.append(d); }
  else if (G.reference) b.append(el('div', {id: 'first-divergence', class: 'note'}, 'No node differs beyond the error threshold.'));
  if (G.culprit) { const d = el('div', {id: 'culprit', class: 'div', 'data-node': G.culprit}, 'Culprit: ' + path(G.culprit));
    d.onclick = () => show(G.culprit); b.append(d); }
  G.notes.forEach(t => b.append(el('div', {class: 'note'}, t)));
  const s = G.structure;
  if (s && !s.same) b.append(el('div', {id: 'structure', class: 'note'}, 'Structure differs: ' + s.only_target.length +
    ' node(s) only in the target (' + s.only_target.slice(0, 5).join(', ') + '), ' + s.only_reference.length +
    ' only in the reference (' + s.only_reference.slice(0, 5).join(', ') + ')'));
  if (DATA.problems.length) { const d = el('details', {class: 'note'}), s = el('summary', {}, DATA.problems.length +
    ' problem(s) in the input'); d.append(s); DATA.problems.forEach(t => d.append(el('div', {}, t))); b.append(d); }
}
function anc(name) { const out = []; let p = G.nodes[name].p; while (p && p !== G.root) { out.unshift(p); p = G.nodes[p].p; } return out; }
function load(i) {
  G = DATA.graphs[i]; items = {}; const tree = document.getElementById('tree'); tree.replaceChildren();
  const ul = el('ul'); ul.append(renderNode(G.root)); tree.append(ul); fixClasses();
  items[G.root].querySelector('details').open = true; banner();
  if (G.first) reveal(G.first); if (G.culprit) reveal(G.culprit);
}
const which = document.getElementById('which');
DATA.graphs.forEach((g, i) => which.append(el('option', {value: i}, g.label)));
which.onchange = () => load(+which.value);
document.getElementById('search').oninput = e => search(e.target.value);
load(0);
const frag = new URLSearchParams(location.hash.slice(1));
if (frag.get('search')) { document.getElementById('search').value = frag.get('search'); search(frag.get('search')); }
if (frag.get('node') && G.nodes[frag.get('node')]) show(frag.get('node'));
</script></body></html>
"""
