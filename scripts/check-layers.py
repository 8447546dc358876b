#!/usr/bin/env python3
"""check-layers: every #include "..." of the tree's C and C++ sources stays inside the edges
docs/layers.md allows (its block of `module: may include ...` lines), so a lower layer
never reaches into a higher one. Run by CTest as layers_include_check (the test command).

usage: check-layers.py [--root DIR] [--rules FILE]
  --root DIR    the tree to check (default: this script's repository)
  --rules FILE  the file holding the rules block (default: ROOT/docs/layers.md)
Exit 0 when every include is allowed; 1 naming each file, line, include and the rule it
breaks; 2 on a usage error or a rules block that cannot be read.
"""
import argparse
import os
import re
import sys

from source_tree import quoted_includes, tree_sources

RULE = re.compile(r"^([a-z_]+):\s*(.*)$")
# Not product code: tests, benches and fuzzers may include any layer. Build trees in the
# source tree (build/, build-asan/, any folder holding a CMakeCache.txt) are skipped too.
SKIPPED = ("tests", "integrations", "docs", "scripts")


def module_of(path):
    """The layer a tree path (or an include path) belongs to; None for a path of no layer."""
    parts = path.split("/")
    if parts[0] == "kvshare" and len(parts) > 2 and parts[1] == "remote":
        return "remote"
    if len(parts) == 1:
        return None
    return parts[0]


def read_rules(path):
    """{module: set of modules it may include} from the block between the markers."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as error:
        raise SystemExit("check-layers: cannot read the rules in %s: %s" % (path, error.strerror))
    match = re.search(r"<!-- layers:begin -->\s*```[a-z]*\n(.*?)```\s*<!-- layers:end -->", text, re.S)
    if not match:
        print("check-layers: %s has no rules block (```...``` between <!-- layers:begin --> and "
              "<!-- layers:end -->)" % path, file=sys.stderr)
        sys.exit(2)
    rules = {}
    for number, line in enumerate(match.group(1).splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        rule = RULE.match(line)
        if not rule:
            print("check-layers: %s: rules line %d %r is not `module: module ...`" % (path, number, line),
                  file=sys.stderr)
            sys.exit(2)
        rules[rule.group(1)] = set(rule.group(2).split()) | {rule.group(1)}
    return rules


def main():
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=here)
    parser.add_argument("--rules")
    args = parser.parse_args()
    rules = read_rules(args.rules or os.path.join(args.root, "docs", "layers.md"))
    broken, checked = [], 0
    for path in sorted(tree_sources(args.root, SKIPPED)):
        mine = module_of(path)
        if mine is None:
            continue
        if mine not in rules:
            broken.append("%s: the folder %s/ has no rule in the rules block" % (path, mine))
            continue
        for number, target in quoted_includes(os.path.join(args.root, path)):
            # the C API's own header, found through its include directory
            theirs = "capi" if target == "kvshare.h" else module_of(target)
            checked += 1
            if theirs is None or theirs not in rules or theirs in rules[mine]:
                continue
            broken.append("%s:%d: #include \"%s\": %s/ may include only %s" %
                          (path, number, target, mine, ", ".join(sorted(rules[mine]))))
    for line in broken:
        print("check-layers: " + line, file=sys.stderr)
    if broken:
        print("check-layers: %d include(s) cross the layers of docs/layers.md" % len(broken), file=sys.stderr)
        return 1
    print("check-layers: %d includes checked, every one inside the layers" % checked)
    return 0


if __name__ == "__main__":
    sys.exit(main())
