// report.html's templates and the page builder (src/report/page.h). The markup lives in the
// mustache templates below (kainjow/mustache: logic-less, HTML-escaping {{name}}; {{{name}}}
// only for the page's own CSS, JS, chart JSON and SVG); the C++ only fills in their data.
#include "report/page.h"

#include <fmt/format.h>

#include <cmath>
#include <ctime>
#include <functional>
#include <stdexcept>

namespace kiln::report {

using nlohmann::json;
namespace mustache = kainjow::mustache;

namespace {

// The page: first screen (scorecard, comparison, identity), then one <section> per part.
const char* kPageTemplate = R"(<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>kiln report: {{title}}</title>
<style>{{{style}}}</style>
{{#has_chartjs}}<script>
{{{chartjs}}}
</script>{{/has_chartjs}}
</head><body>
<h1>kiln report: {{title}}</h1>
{{#scorecard}}{{>scorecard_template}}{{/scorecard}}
{{#identity}}{{>identity_template}}{{/identity}}
<p class="missing">{{missing_line}}</p>
{{#sections}}{{>section_template}}{{/sections}}
<p class="note">Generated {{generated}} from {{source}}. {{charts_note}}</p>
{{#has_chartjs}}<script>{{{chart_script}}}</script>{{/has_chartjs}}
</body></html>
)";

const char* kScorecardTemplate = R"(<section id="scorecard"><h2>The ladder</h2>
<table class="scorecard"><tr><th>rung</th><th>status</th><th>result</th><th>decision</th><th>config key</th><th></th></tr>
{{#rows}}<tr class="rung {{status_class}}" data-rung="{{rung}}"><td class="name">{{rung}}</td><td class="status">{{status}}</td><td class="result">{{#figures}}<span class="figure" data-name="{{name}}" data-exact="{{exact}}">{{text}}</span>{{/figures}}{{^figures}}-{{/figures}}</td><td class="decision">{{decision}}</td><td class="key">{{#key}}<code>{{key}}</code>{{/key}}</td><td>{{#link}}<a href="#{{link}}">section</a>{{/link}}</td></tr>
{{/rows}}</table>
{{#next}}<p class="next"><b>Next:</b> {{next}}</p>{{/next}}
</section>
)";

const char* kIdentityTemplate = R"(<section id="identity"><h2>Run identity</h2>
<table class="measures identity">{{#rows}}<tr data-name="{{name}}"><th>{{key}}</th>{{#values}}<td>{{.}}</td>{{/values}}</tr>
{{/rows}}</table></section>
)";

const char* kSectionTemplate = R"(<section class="part" id="{{id}}"><h2>{{heading}}</h2>
{{#intro}}<p class="verdict">{{intro}}</p>{{/intro}}
{{#blocks}}{{>block_template}}{{/blocks}}</section>
)";

// One block of a section: exactly one of these keys is set on it.
const char* kBlockTemplate =
    R"({{#subsection}}<h3>{{title}}</h3>
{{/subsection}}{{#paragraph}}<p class="{{css}}">{{text}}</p>
{{/paragraph}}{{#measures}}<table class="measures">{{#rows}}<tr><th>{{key}}</th><td>{{value}}</td></tr>{{/rows}}</table>
{{/measures}}{{#grid}}<div class="wide"><table class="{{css}}"><tr>{{#headers}}<th>{{.}}</th>{{/headers}}</tr>
{{#rows}}<tr class="row{{#chosen}} chosen{{/chosen}}">{{#cells}}<td>{{.}}</td>{{/cells}}</tr>
{{/rows}}</table></div>
{{/grid}}{{#bullets}}<p>{{title}}:</p><ul>{{#items}}<li>{{.}}</li>{{/items}}</ul>
{{/bullets}}{{#chart}}<div class="chart-box">{{#canvas}}<div class="canvas"><canvas id="{{id}}"></canvas></div><script type="application/json" class="chart-config" data-chart="{{id}}">{{{config}}}</script>{{/canvas}}{{{svg}}}
<div class="aside">{{#log_toggle}}<label><input type="checkbox" class="log-scale" data-chart="{{id}}"> log scale</label>{{/log_toggle}}
<details class="numbers"><summary>the numbers</summary><table>{{#rows}}<tr>{{#cells}}<td>{{.}}</td>{{/cells}}</tr>{{/rows}}</table></details></div></div>
{{/chart}}{{#details}}<details class="dump"><summary>{{summary}}</summary><table class="measures">{{#rows}}<tr><th>{{key}}</th><td>{{value}}</td></tr>{{/rows}}</table></details>
{{/details}}{{#compare}}<table class="comparison"><tr><th>rung</th><th>measure</th><th>A</th><th>B</th><th>B - A</th></tr>
{{#rows}}<tr class="compare" data-rung="{{rung}}" data-name="{{name}}"><td>{{rung}}</td><td>{{measure}}</td><td class="a" data-exact="{{a_exact}}">{{a_text}}</td><td class="b" data-exact="{{b_exact}}">{{b_text}}</td><td class="difference">{{difference}}</td></tr>
{{/rows}}</table>
{{/compare}})";

const char* kStyle = R"(body{font-family:sans-serif;margin:2em;max-width:1400px;color:#222}
h2{border-bottom:1px solid #ccc;padding-bottom:4px;margin-top:1.6em}
h3{margin:1.2em 0 .3em;font-size:1.05em;color:#444}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:3px 7px;text-align:right}
table.measures th,table.identity td,table.scorecard td,table.scorecard th{text-align:left}
table.scorecard{font-size:14px}table.scorecard td.result .figure{display:block;font-weight:bold}
tr.passed td.status{color:#1a7f37;font-weight:bold}tr.failed td.status{color:#c62828;font-weight:bold}
tr.unreadable td.status{color:#b26a00;font-weight:bold}tr.absent td{color:#999}
p.next{font-size:15px;background:#f3f7ff;border-left:4px solid #1f77b4;padding:6px 10px}
p.error{color:#c62828;font-weight:bold}p.verdict{font-size:15px}.note,.missing{color:#555;font-style:italic}
.chart-box{display:flex;gap:1.5em;align-items:flex-start;margin:1em 0}
.canvas{position:relative;width:640px;height:280px;flex:none}
.aside{font-size:12px;max-height:300px;overflow:auto}
.wide{overflow-x:auto;margin:1em 0}tr.chosen td{background:#e6f2e6;font-weight:bold}
details.dump{margin:.6em 0}summary{cursor:pointer;color:#1f4f8f}
table.comparison td.difference{font-weight:bold})";

// Builds each chart from its JSON beside its canvas; the log-scale boxes switch the y axis.
const char* kChartScript = R"((function() {
  document.querySelectorAll('script.chart-config').forEach(function(s) {
    new Chart(document.getElementById(s.dataset.chart), JSON.parse(s.textContent));
  });
  document.querySelectorAll('input.log-scale').forEach(function(box) {
    box.addEventListener('change', function() {
      var chart = Chart.getChart(box.dataset.chart);
      chart.options.scales.y.type = box.checked ? 'logarithmic' : 'linear';
      chart.update();
    });
  });
})();)";

Data string_list(const std::vector<std::string>& items) {
  Data list{Data::type::list};
  for (const auto& item : items) list.push_back(Data(item));
  return list;
}

Data rows_data(const Rows& rows) {
  Data list{Data::type::list};
  for (const auto& [key, value] : rows) {
    Data row;
    row.set("key", key);
    row.set("value", value);
    list.push_back(row);
  }
  return list;
}

std::string exact_text(double value) {
  return std::isfinite(value) ? fmt::format("{}", value) : "";
}

}  // namespace

Section::Section(std::string id, std::string heading, bool chartjs,
                 std::vector<std::string>* chart_ids)
    : id_(std::move(id)), heading_(std::move(heading)), chartjs_(chartjs), chart_ids_(chart_ids) {}

void Section::add(const std::string& kind, Data value) {
  Data block;
  block.set(kind, value);
  blocks_.push_back(block);
}

void Section::intro(const std::string& text) {
  intro_ = text;
}

void Section::subsection(const std::string& title) {
  Data d;
  d.set("title", title);
  add("subsection", d);
}

void Section::paragraph(const std::string& text, const std::string& css_class) {
  Data d;
  d.set("text", text);
  d.set("css", css_class);
  add("paragraph", d);
}

void Section::measures(const Rows& rows) {
  if (rows.empty()) return;
  Data d;
  d.set("rows", rows_data(rows));
  add("measures", d);
}

void Section::grid(const std::vector<std::string>& headers,
                   const std::vector<std::vector<std::string>>& rows, int marked,
                   const std::string& css_class) {
  Data list{Data::type::list};
  for (size_t r = 0; r < rows.size(); ++r) {
    Data row;
    row.set("chosen", static_cast<int>(r) == marked);
    row.set("cells", string_list(rows[r]));
    list.push_back(row);
  }
  Data d;
  d.set("css", css_class);
  d.set("headers", string_list(headers));
  d.set("rows", list);
  add("grid", d);
}

void Section::bullets(const std::string& title, const std::vector<std::string>& items) {
  if (items.empty()) return;
  Data d;
  d.set("title", title);
  d.set("items", string_list(items));
  add("bullets", d);
}

void Section::chart(Chart chart) {
  chart.id = "chart-" + chart.id;
  Data d;
  d.set("id", chart.id);
  d.set("log_toggle", chartjs_ && chart.log_toggle);
  if (chartjs_) {
    Data canvas;
    canvas.set("config", script_json(chartjs_config(chart)));
    d.set("canvas", canvas);
    d.set("svg", std::string());
  } else {
    d.set("canvas", false);
    d.set("svg", svg_chart(chart));
  }
  Data rows{Data::type::list};
  for (const auto& cells : chart_rows(chart)) {
    Data row;
    row.set("cells", string_list(cells));
    rows.push_back(row);
  }
  d.set("rows", rows);
  add("chart", d);
  if (chart_ids_) chart_ids_->push_back(chart.id);
}

void Section::details(const std::string& summary, const Rows& rows) {
  if (rows.empty()) return;
  Data d;
  d.set("summary", summary);
  d.set("rows", rows_data(rows));
  add("details", d);
}

void Section::compare(const std::vector<CompareRow>& rows) {
  Data list{Data::type::list};
  for (const auto& r : rows) {
    Data row;
    row.set("rung", r.rung);
    row.set("measure", r.measure);
    row.set("name", r.name);
    row.set("a_text", r.a_text);
    row.set("b_text", r.b_text);
    row.set("a_exact", exact_text(r.a_exact));
    row.set("b_exact", exact_text(r.b_exact));
    row.set("difference", r.difference);
    list.push_back(row);
  }
  Data d;
  d.set("rows", list);
  add("compare", d);
}

Data Section::data() const {
  Data d;
  d.set("id", id_);
  d.set("heading", heading_);
  if (!intro_.empty()) d.set("intro", intro_);
  d.set("blocks", blocks_);
  return d;
}

std::string render_page(const PageParts& parts) {
  Data root;
  root.set("title", parts.title);
  root.set("source", parts.source);
  root.set("style", kStyle);
  root.set("has_chartjs", !parts.chartjs.empty());
  root.set("chartjs", parts.chartjs);
  root.set("chart_script", kChartScript);
  root.set("charts_note", parts.charts_note);
  root.set("missing_line", parts.missing_line);
  root.set("generated", [] {
    const std::time_t now = std::time(nullptr);
    std::tm utc{};
    gmtime_r(&now, &utc);
    char text[32];
    std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", &utc);
    return std::string(text);
  }());
  root.set("scorecard", parts.scorecard);
  root.set("identity", parts.identity);
  Data sections{Data::type::list};
  for (const auto& s : parts.sections) sections.push_back(s.data());
  root.set("sections", sections);
  for (const auto& [name, text] : {std::pair{"scorecard_template", kScorecardTemplate},
                                   std::pair{"identity_template", kIdentityTemplate},
                                   std::pair{"section_template", kSectionTemplate},
                                   std::pair{"block_template", kBlockTemplate}}) {
    mustache::mustache check{text};
    if (!check.is_valid()) {
      throw std::logic_error(fmt::format("report template {}: {}", name, check.error_message()));
    }
    const std::string copy = text;
    root.set(name, mustache::partial([copy] { return copy; }));
  }
  mustache::mustache page{kPageTemplate};
  if (!page.is_valid()) throw std::logic_error("report page template: " + page.error_message());
  std::string html = page.render(root);
  if (!page.error_message().empty()) {
    throw std::logic_error("report page template: " + page.error_message());
  }
  return html;
}

Rows flatten(const json& value) {
  Rows rows;
  std::function<void(const json&, const std::string&)> walk = [&](const json& v,
                                                                  const std::string& prefix) {
    if (v.is_object()) {
      for (const auto& [key, inner] : v.items())
        walk(inner, prefix.empty() ? key : prefix + "." + key);
    } else if (v.is_number()) {
      rows.emplace_back(prefix, number(v.get<double>()));
    } else if (v.is_string()) {
      rows.emplace_back(prefix, v.get<std::string>());
    } else if (v.is_array()) {
      rows.emplace_back(prefix, v.size() > 8
                                    ? fmt::format("{} items", v.size())
                                    : v.dump(-1, ' ', false, json::error_handler_t::replace));
    } else {
      rows.emplace_back(prefix, v.dump());
    }
  };
  walk(value, "");
  return rows;
}

}  // namespace kiln::report
