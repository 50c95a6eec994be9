#pragma once

#include <nlohmann/json.hpp>

#include <memory>
#include <string>

namespace troupe {

/// A Jinja template in the subset that models' chat templates use, rendered as transformers
/// renders them (jinja2 with `trim_blocks`, `lstrip_blocks` and loop controls, its own
/// `tojson`, `raise_exception` and `strftime_now`).
///
/// The subset: text, `{{ }}` and `{# #}` with whitespace control (`-`, `+`); `if`/`elif`/
/// `else`, `for` (with `else`, a filter condition, unpacking, `loop.*`, `break`,
/// `continue`), `set` (names, `namespace` attributes, unpacking, blocks), `macro`,
/// `generation`; Python-like expressions (literals, lists, dicts, tuples, attributes,
/// subscripts and slices, calls with keyword arguments, arithmetic, `~`, comparisons, `in`,
/// `and`/`or`/`not`, `x if c else y`), the common filters and tests, the string and dict
/// methods templates call (`strip`, `split`, `startswith`, `items`, `get`...), and the
/// globals `range`, `namespace`, `dict`, `raise_exception` and `strftime_now`. Strings are
/// UTF-8; their lengths, indices and slices count code points, as Python's do.
class jinja_template {
public:
  /// Parses `source`. Throws `troupe::error`: `invalid_argument` for a syntax error (with
  /// its line), `unsupported` naming a tag, filter or test outside the subset.
  explicit jinja_template(const std::string& source);
  ~jinja_template();
  jinja_template(const jinja_template&) = default;
  jinja_template& operator=(const jinja_template&) = default;

  /// The text for the variables of `context` (an object). Throws `troupe::error`
  /// (`invalid_argument`) with the message of the template's `raise_exception`, or naming
  /// what went wrong (an undefined variable's attribute, a type error, an unknown method).
  std::string render(const nlohmann::ordered_json& context) const;

private:
  struct program;
  std::shared_ptr<const program> program_;
};

} // namespace troupe
