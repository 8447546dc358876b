// The file-name rule of POST /slots/N?action=save|restore: llama.cpp's
// fs_validate_filename(name, allow_subdirs = false) (common/common.cpp), so a name that a
// real llama-server refuses is refused here too, path traversal included.
#pragma once

#include <string_view>

namespace kvshare::decoder {

// 1..255 bytes of valid, shortest-form UTF-8; no C0/DEL/C1 controls, no / \ : * ? " < > |,
// no U+FF0E, U+2215, U+2216, U+FFFD, U+FEFF, no surrogates; no leading or trailing space,
// no trailing '.', no ".." anywhere, not ".".
bool is_valid_slot_filename(std::string_view name);

}  // namespace kvshare::decoder
