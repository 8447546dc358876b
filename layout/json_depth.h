// Counting a JSON text's nesting before parsing it: nlohmann's parser recurses once per
// level (building and later destroying a value per level), so a hostile document of a
// million '[' would exhaust the stack. Callers refuse anything deeper than they need.
#pragma once

#include <string_view>

namespace kvshare::layout {

// The deepest [ / { nesting of `text`, counted outside strings. Cheap (one pass, no
// allocation) and tolerant: it does not validate, the parser after it does.
int json_nesting_depth(std::string_view text);

}  // namespace kvshare::layout
