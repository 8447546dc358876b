// Counting a JSON text's nesting before parsing it. nlohmann's parser keeps its own stack,
// but a parsed value's copy, comparison and dump() recurse once per level, and so do our
// readers that walk it: a hostile document of a million '[' would exhaust the stack there.
// Callers refuse anything deeper than they need before the value exists.
#pragma once

#include <string_view>

namespace kvshare::layout {

// The deepest [ / { nesting of `text`, counted outside strings. Cheap (one pass, no
// allocation) and tolerant: it does not validate, the parser after it does.
int json_nesting_depth(std::string_view text);

}  // namespace kvshare::layout
