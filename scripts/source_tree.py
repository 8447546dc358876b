"""What check-layers.py and check-links.py both read: the tree's C and C++ files, and the
quoted includes of one of them. Build trees inside the source tree (build/, build-asan/,
any folder holding a CMakeCache.txt) and hidden folders are never part of the tree."""
import os
import re

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
SOURCE_SUFFIXES = (".h", ".hpp", ".c", ".cc", ".cpp")


def tree_sources(root, skipped_top=()):
    """Every C or C++ file below `root` (paths relative to it); `skipped_top` names top-level
    folders to leave out as well."""
    found = []
    for directory, dirs, files in os.walk(root):
        relative = os.path.relpath(directory, root)
        dirs[:] = [d for d in dirs if not d.startswith((".", "build")) and
                   not (relative == "." and d in skipped_top) and
                   not os.path.exists(os.path.join(directory, d, "CMakeCache.txt"))]
        found += [os.path.normpath(os.path.join(relative, name)) for name in files if name.endswith(SOURCE_SUFFIXES)]
    return found


def quoted_includes(path):
    """[(line number, name)] of each `#include "name"` of the file at `path`."""
    with open(path, errors="replace") as f:
        return [(number, include.group(1)) for number, include in enumerate(map(INCLUDE.match, f), 1) if include]
