/* Inside the Layer: the static book's explorers.
 *
 * A chapter's explorer is precomputed at build time over every setting of its controls
 * (intralayer.widgets.Explorer.table, written to _static/explorers/<chapter>.js as
 * window.ITL_EXPLORERS[name]). This script finds each placeholder
 * <div class="itl-explorer" data-explorer="name">, builds the sliders and dropdowns, and
 * draws the chart of the selected setting as SVG (the vocabulary of intralayer.charts:
 * bars, heatmap, text). No kernel, no network.
 */
(function () {
  "use strict";
  var SVG = "http://www.w3.org/2000/svg";

  function humanBytes(n) {
    var units = ["B", "KiB", "MiB", "GiB", "TiB"];
    for (var i = 0; i < units.length; i++) {
      var shown = (units[i] === "B" || n === Math.round(n)) ? n.toFixed(0) : n.toFixed(1);
      if (Math.abs(parseFloat(shown)) < 1024 || units[i] === "TiB") return shown + " " + units[i];
      n /= 1024;
    }
  }

  function sig3(x) {
    return String(parseFloat(x.toPrecision(3)));
  }

  function humanSeconds(t) {
    if (t === 0) return "0";
    var scales = [[1, "s"], [1e-3, "ms"], [1e-6, "µs"], [1e-9, "ns"]];
    for (var i = 0; i < scales.length; i++) {
      if (parseFloat((Math.abs(t) / scales[i][0]).toPrecision(3)) >= 1 || scales[i][1] === "ns") {
        return sig3(t / scales[i][0]) + " " + scales[i][1];
      }
    }
  }

  function niceStep(span, nbins) {
    var raw = span / nbins, mag = Math.pow(10, Math.floor(Math.log10(raw)));
    var steps = [1, 2, 2.5, 5, 10];
    for (var i = 0; i < steps.length; i++) if (steps[i] * mag >= raw) return steps[i] * mag;
    return 10 * mag;
  }

  /* Tick values and labels of a value axis from 0 to top, in the panel's unit. */
  function ticks(top, unit) {
    var scale = 1;
    if (unit === "bytes") scale = Math.pow(1024, Math.max(0, Math.floor(Math.log(Math.max(top, 1)) / Math.log(1024))));
    var step = niceStep(top / scale, 4) * scale, out = [];
    for (var v = 0; v <= top * (1 + 1e-9); v += step) {
      var label = unit === "bytes" ? humanBytes(v) : unit === "seconds" ? humanSeconds(v) : sig3(v);
      out.push([v, label]);
      if (out.length > 12) break;
    }
    return out;
  }

  function node(tag, attrs, parent, text) {
    var el = document.createElementNS(SVG, tag);
    for (var k in attrs) el.setAttribute(k, attrs[k]);
    if (text !== undefined) el.textContent = text;
    if (parent) parent.appendChild(el);
    return el;
  }

  function html(tag, cls, parent, text) {
    var el = document.createElement(tag);
    if (cls) el.className = cls;
    if (text !== undefined) el.textContent = text;
    if (parent) parent.appendChild(el);
    return el;
  }

  function legend(series, parent) {
    var box = html("div", "itl-legend", parent);
    series.forEach(function (s) {
      if (!s.label) return;
      var item = html("span", "itl-legend-item", box);
      var swatch = html("span", "itl-swatch", item);
      swatch.style.background = s.color;
      item.appendChild(document.createTextNode(s.label));
    });
  }

  function textWidth(s, px) { return 0.58 * px * s.length; }

  function drawBars(p, parent) {
    var n = p.categories.length, W = 470, labelW, H, plot;
    var tick = ticks(p.top, p.unit);
    if (p.horizontal) {
      labelW = Math.min(170, 12 + Math.max.apply(null, p.categories.map(function (c) { return textWidth(c, 11); })));
      var row = n > 8 ? 14 : 30;
      H = 34 + n * row + 34;
      plot = {x: labelW, y: 26, w: W - labelW - 12, h: n * row};
    } else {
      labelW = 58;
      H = 250;
      plot = {x: labelW, y: 26, w: W - labelW - 12, h: H - 26 - 50};
    }
    var svg = node("svg", {width: W, height: H, viewBox: "0 0 " + W + " " + H, "class": "itl-svg"}, parent);
    node("text", {x: W / 2, y: 15, "text-anchor": "middle", "class": "itl-panel-title"}, svg, p.title);
    function val(v) { return (p.horizontal ? plot.w : plot.h) * Math.min(v, p.top) / p.top; }
    tick.forEach(function (t) {            // grid and value-axis labels
      var d = val(t[0]);
      if (p.horizontal) {
        node("line", {x1: plot.x + d, x2: plot.x + d, y1: plot.y, y2: plot.y + plot.h, "class": "itl-grid"}, svg);
        node("text", {x: plot.x + d, y: plot.y + plot.h + 14, "text-anchor": "middle", "class": "itl-tick"}, svg, t[1]);
      } else {
        node("line", {x1: plot.x, x2: plot.x + plot.w, y1: plot.y + plot.h - d, y2: plot.y + plot.h - d, "class": "itl-grid"}, svg);
        node("text", {x: plot.x - 5, y: plot.y + plot.h - d + 4, "text-anchor": "end", "class": "itl-tick"}, svg, t[1]);
      }
    });
    var band = (p.horizontal ? plot.h : plot.w) / n, thick = band * 0.8;
    var shown = n <= 16 ? p.categories.map(function (_, i) { return i; }) : [0, Math.floor(n / 2), n - 1];
    if (!p.horizontal) {                   // side by side: keep every step-th label so none overlap
      var widest = Math.max.apply(null, shown.map(function (i) { return textWidth(p.categories[i], 11); }));
      var step = Math.max(1, Math.ceil((widest + 6) / (band * (n <= 16 ? 1 : n / 3))));
      shown = shown.filter(function (_, j) { return j % step === 0; });
    }
    for (var i = 0; i < n; i++) {
      var base = 0;
      p.series.forEach(function (s) {
        var a = val(base), b = val(base + s.values[i]);
        base += s.values[i];
        if (b - a <= 0) return;
        var r = p.horizontal
          ? {x: plot.x + a, y: plot.y + i * band + (band - thick) / 2, width: b - a, height: thick}
          : {x: plot.x + i * band + (band - thick) / 2, y: plot.y + plot.h - b, width: thick, height: b - a};
        r.fill = s.color;
        r["class"] = "itl-bar";
        var rect = node("rect", r, svg);
        node("title", {}, rect, (s.label ? s.label + ": " : "") + p.categories[i]);
      });
      if (p.ends) {
        if (p.horizontal) node("text", {x: plot.x + val(base) + 5, y: plot.y + (i + 0.5) * band + 4, "class": "itl-end"}, svg, p.ends[i]);
        else node("text", {x: plot.x + (i + 0.5) * band, y: plot.y + plot.h - val(base) - 4, "text-anchor": "middle", "class": "itl-end"}, svg, p.ends[i]);
      }
      if (shown.indexOf(i) >= 0) {
        if (p.horizontal) node("text", {x: plot.x - 6, y: plot.y + (i + 0.5) * band + 4, "text-anchor": "end", "class": "itl-cat"}, svg, p.categories[i]);
        else node("text", {x: plot.x + (i + 0.5) * band, y: plot.y + plot.h + 14, "text-anchor": "middle", "class": "itl-cat"}, svg, p.categories[i]);
      }
    }
    p.rules.forEach(function (r) {
      var d = val(r[0]);
      if (p.horizontal) {
        node("line", {x1: plot.x + d, x2: plot.x + d, y1: plot.y - 4, y2: plot.y + plot.h, "class": "itl-rule"}, svg);
        var right = d > 0.7 * plot.w;      // near the right edge: label to the left of the line
        node("text", {x: plot.x + d + (right ? -3 : 3), y: plot.y + 8, "text-anchor": right ? "end" : "start",
                      "class": "itl-end itl-rule-label"}, svg, r[1]);
      } else {
        node("line", {x1: plot.x, x2: plot.x + plot.w, y1: plot.y + plot.h - d, y2: plot.y + plot.h - d, "class": "itl-rule"}, svg);
        node("text", {x: plot.x + plot.w, y: plot.y + plot.h - d - 4, "text-anchor": "end", "class": "itl-end itl-rule-label"}, svg, r[1]);
      }
    });
    node("line", {x1: plot.x, x2: plot.x, y1: plot.y, y2: plot.y + plot.h, "class": "itl-axis"}, svg);
    node("line", {x1: plot.x, x2: plot.x + plot.w, y1: plot.y + plot.h, y2: plot.y + plot.h, "class": "itl-axis"}, svg);
    if (p.category_label) {
      if (p.horizontal) node("text", {x: 10, y: plot.y + plot.h / 2, "text-anchor": "middle", transform: "rotate(-90 10 " + (plot.y + plot.h / 2) + ")", "class": "itl-label"}, svg, p.category_label);
      else node("text", {x: plot.x + plot.w / 2, y: plot.y + plot.h + 30, "text-anchor": "middle", "class": "itl-label"}, svg, p.category_label);
    }
    if (p.label) {
      if (p.horizontal) node("text", {x: plot.x + plot.w / 2, y: plot.y + plot.h + 30, "text-anchor": "middle", "class": "itl-label"}, svg, p.label);
      else node("text", {x: 12, y: plot.y + plot.h / 2, "text-anchor": "middle", transform: "rotate(-90 12 " + (plot.y + plot.h / 2) + ")", "class": "itl-label"}, svg, p.label);
    }
    if (p.legend) legend(p.series, parent);
    if (p.note) p.note.split("\n").forEach(function (line) { html("div", "itl-note", parent, line); });
  }

  function blues(f) {                      // white → dark blue, like matplotlib's "Blues"
    var lo = [247, 251, 255], hi = [8, 48, 107];
    return "rgb(" + lo.map(function (c, i) { return Math.round(c + (hi[i] - c) * f); }).join(",") + ")";
  }

  function drawHeatmap(p, parent) {
    var n = p.matrix.length, cell = Math.min(24, 280 / n), pad = 44;
    var W = pad + n * cell + 20, H = 26 + n * cell + 40;
    var svg = node("svg", {width: W, height: H, viewBox: "0 0 " + W + " " + H, "class": "itl-svg"}, parent);
    node("text", {x: W / 2, y: 15, "text-anchor": "middle", "class": "itl-panel-title"}, svg, p.title);
    var top = 0;
    p.matrix.forEach(function (row) { row.forEach(function (v) { top = Math.max(top, v); }); });
    p.matrix.forEach(function (row, i) {
      row.forEach(function (v, j) {
        var rect = node("rect", {x: pad + j * cell, y: 26 + i * cell, width: cell, height: cell, fill: blues(top ? v / top : 0), "class": "itl-cell"}, svg);
        node("title", {}, rect, i + " → " + j + ": " + v);
      });
    });
    p.dividers.forEach(function (d) {
      node("line", {x1: pad + d * cell, x2: pad + d * cell, y1: 26, y2: 26 + n * cell, "class": "itl-divider"}, svg);
      node("line", {x1: pad, x2: pad + n * cell, y1: 26 + d * cell, y2: 26 + d * cell, "class": "itl-divider"}, svg);
    });
    var shown = n <= 16 ? p.matrix.map(function (_, i) { return i; }) : [0, n - 1];
    shown.forEach(function (i) {
      node("text", {x: pad + (i + 0.5) * cell, y: 26 + n * cell + 12, "text-anchor": "middle", "class": "itl-tick"}, svg, String(i));
      node("text", {x: pad - 4, y: 26 + (i + 0.5) * cell + 4, "text-anchor": "end", "class": "itl-tick"}, svg, String(i));
    });
    node("text", {x: pad + n * cell / 2, y: H - 6, "text-anchor": "middle", "class": "itl-label"}, svg, p.xlabel);
    node("text", {x: 10, y: 26 + n * cell / 2, "text-anchor": "middle", transform: "rotate(-90 10 " + (26 + n * cell / 2) + ")", "class": "itl-label"}, svg, p.ylabel);
  }

  function drawText(p, parent) {
    var box = html("div", "itl-text", parent);
    if (p.title) html("div", "itl-panel-title", box, p.title);
    p.lines.forEach(function (line) { html("div", "", box, line); });
  }

  function draw(out, data) {
    out.textContent = "";
    if (data.invalid) {
      html("p", "itl-invalid", out, data.invalid);
      return;
    }
    html("div", "itl-chart-title", out, data.title);
    var row = html("div", "itl-panels", out);
    data.panels.forEach(function (p) {
      var cell = html("div", "itl-panel", row);
      if (p.kind === "bars") drawBars(p, cell);
      else if (p.kind === "heatmap") drawHeatmap(p, cell);
      else drawText(p, cell);
    });
  }

  function mount(div) {
    var table = (window.ITL_EXPLORERS || {})[div.getAttribute("data-explorer")];
    if (!table) return;
    div.textContent = "";
    div.classList.add("itl-ready");
    html("div", "itl-explorer-title", div, table.title);
    var controls = html("div", "itl-controls", div);
    var out = html("div", "itl-out", div);
    var index = table.controls.map(function (c) { return c.start; });
    function update() {                   // the setting's place in the grid: last control fastest
      var position = 0;
      table.controls.forEach(function (c, k) { position = position * c.labels.length + index[k]; });
      out.setAttribute("data-key", index.join("-"));
      draw(out, table.outputs[table.index[position]]);
    }
    table.controls.forEach(function (c, k) {
      var line = html("label", "itl-control", controls);
      html("span", "itl-control-name", line, c.name);
      var input, shown;
      if (c.numeric) {
        input = html("input", "", line);
        input.type = "range";
        input.min = 0;
        input.max = c.labels.length - 1;
        input.step = 1;
        input.value = c.start;
        shown = html("output", "itl-control-value", line, c.labels[c.start]);
      } else {
        input = html("select", "", line);
        c.labels.forEach(function (label, i) {
          var opt = html("option", "", input, label);
          opt.value = i;
        });
        input.value = c.start;
      }
      input.setAttribute("data-control", c.name);
      input.addEventListener("input", function () {
        index[k] = parseInt(input.value, 10);
        if (shown) shown.textContent = c.labels[index[k]];
        update();
      });
      input.addEventListener("change", function () {
        index[k] = parseInt(input.value, 10);
        if (shown) shown.textContent = c.labels[index[k]];
        update();
      });
    });
    update();
  }

  function start() {
    Array.prototype.forEach.call(document.querySelectorAll(".itl-explorer"), mount);
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
