// report.html's page (private to src/report): sections of blocks (tables, charts, folds) turned
// into data for the page's mustache templates (src/report/templates.cpp). No markup is written
// here: every element comes from a template.
#pragma once

#include <kainjow/mustache.hpp>
#include <string>
#include <utility>
#include <vector>

#include "report/charts.h"

namespace kiln::report {

using Rows = std::vector<std::pair<std::string, std::string>>;
using Data = kainjow::mustache::data;

/// A figure as the page shows it, with its exact value for readers (data-exact).
struct Figure {
  std::string name;  // what it is: "tokens_per_second"
  std::string text;  // as shown: "12,345 tokens/s"
  double exact = 0;  // the value it shows (NaN: none)
};

/// One row of the comparison table: a rung's figure in run A and run B, and their difference.
struct CompareRow {
  std::string rung, measure, name;
  std::string a_text, b_text, difference;
  double a_exact = 0, b_exact = 0;
};

class Section {
 public:
  Section(std::string id, std::string heading, bool chartjs, std::vector<std::string>* chart_ids);
  void intro(const std::string& text);
  void subsection(const std::string& title);
  void paragraph(const std::string& text, const std::string& css_class = "");
  void error(const std::string& text) { paragraph(text, "error"); }
  void measures(const Rows& rows);
  /// A table with a header row; row `marked` (when >= 0) gets class "chosen"; each row has class
  /// "row"; `css_class` is the table's class.
  void grid(const std::vector<std::string>& headers,
            const std::vector<std::vector<std::string>>& rows, int marked,
            const std::string& css_class);
  void bullets(const std::string& title, const std::vector<std::string>& items);
  void chart(Chart chart);
  /// A key/value dump behind a <details> fold.
  void details(const std::string& summary, const Rows& rows);
  void compare(const std::vector<CompareRow>& rows);
  Data data() const;

 private:
  void add(const std::string& kind, Data value);
  std::string id_, heading_, intro_;
  bool chartjs_;
  std::vector<std::string>* chart_ids_;
  Data blocks_{Data::type::list};
};

/// The whole page: the title, the first screen (scorecard and identity, when given), sections.
struct PageParts {
  std::string title, source;
  std::string chartjs;           // the library's text, or empty (plain SVG)
  std::string charts_note;       // where the charts come from
  std::string missing_line;      // "Not in this run: ..." or "Every run file ... is here."
  Data scorecard = Data(false);  // {rows: [...], next: "..."}, or false: none
  Data identity = Data(false);   // {rows: [...]}, or false: none
  std::vector<Section> sections;
};

/// Renders the page template. Throws std::logic_error when a template does not parse (a bug).
std::string render_page(const PageParts& parts);

/// A key/value dump of a JSON object (nested keys joined with '.'), for a <details> fold.
Rows flatten(const nlohmann::json& value);

}  // namespace kiln::report
