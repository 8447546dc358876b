#!/usr/bin/env python3
"""check-links: every library and binary of the build links exactly the kvshare libraries
whose headers it includes, so a binary that includes a module it does not declare fails
this check instead of building by accident through another library's dependencies, and a
library links PUBLIC exactly what its own headers include (docs/layers.md, "What each
binary links"). Run by CTest as layers_link_check (the test command).

usage: check-links.py [--root DIR] MANIFEST
  MANIFEST  the build's kvshare-links.txt (scripts/cmake/KvshareLinkManifest.cmake): one line
            per target: name, type, source folder, sources, LINK_LIBRARIES,
            INTERFACE_LINK_LIBRARIES (tab-separated; paths relative to the source tree)
  --root DIR  the source tree (default: this script's repository)
A header belongs to the library that compiles the .cc of the same name beside it, else to
the library that compiles most sources in its folder; a header of no library (a test
fixture, a bench helper) is part of whatever includes it. A target "includes" a library
when one of its sources, or a header of no library they reach, includes one of its headers.
Exit 0 when every link matches; 1 naming each target, the include or the link at fault and
the fix; 2 on a manifest that cannot be read, lists no executable, or names sources that are
not in ROOT (so a wrong path cannot pass for want of anything to check).
"""
import argparse
import collections
import os
import re
import sys

from source_tree import quoted_includes, tree_sources

HEADER_SUFFIXES = (".h", ".hpp")
LINK_ONLY = re.compile(r"^\$<LINK_ONLY:(.*)>$")
FIELDS = ("name", "type", "folder", "sources", "links", "interface_links")


def fail(message):
    print("check-links: " + message, file=sys.stderr)
    sys.exit(2)


def read_manifest(path):
    """{target: {field: value}} with the lists split; only targets that compile something."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as error:
        fail("cannot read the manifest %s: %s (configure the build first: it is written by "
             "scripts/cmake/KvshareLinkManifest.cmake)" % (path, error.strerror))
    targets = {}
    for number, line in enumerate(lines, 1):
        fields = line.split("\t")
        if len(fields) != len(FIELDS):
            fail("%s:%d: %d fields, expected %d (%s)" % (path, number, len(fields), len(FIELDS), ", ".join(FIELDS)))
        target = dict(zip(FIELDS, fields))
        for field in ("sources", "links", "interface_links"):
            target[field] = [item for item in target[field].split(";") if item]
        targets[target["name"]] = target
    # An empty or foreign manifest must not pass for want of anything to check.
    if not any(target["type"] == "EXECUTABLE" for target in targets.values()):
        fail("%s lists no executable: not a manifest of this tree's build" % path)
    return targets


class Tree:
    """The tree's files, who owns each header, and what each file includes."""

    def __init__(self, root, targets):
        self.root = root
        self.files = set(tree_sources(root))
        self.by_name = collections.defaultdict(list)
        for path in self.files:
            self.by_name[os.path.basename(path)].append(path)
        self.libraries = {name for name, target in targets.items() if target["type"].endswith("_LIBRARY")}
        self.by_stem, per_folder = {}, collections.defaultdict(collections.Counter)
        for name in sorted(self.libraries):
            for source in targets[name]["sources"]:
                folder, stem = os.path.dirname(source), os.path.splitext(os.path.basename(source))[0]
                self.by_stem[(folder, stem)] = name
                per_folder[folder][name] += 1
        # Most sources first, then the name, so a tie cannot depend on the manifest's order.
        self.by_folder = {folder: min(counts, key=lambda name: (-counts[name], name))
                          for folder, counts in per_folder.items()}
        self.includes_of = {}

    def owner(self, path):
        """The library a header belongs to, or None."""
        folder, stem = os.path.dirname(path), os.path.splitext(os.path.basename(path))[0]
        return self.by_stem.get((folder, stem)) or self.by_folder.get(folder)

    def resolve(self, includer, name):
        """The tree path of `#include "name"` in `includer`: beside it, from the root, or the
        one file of the tree whose path ends in it (an include directory of the target's)."""
        for candidate in (os.path.join(os.path.dirname(includer), name), name):
            candidate = os.path.normpath(candidate)
            if candidate in self.files:
                return candidate
        suffix = "/" + os.path.normpath(name)
        matches = [path for path in self.by_name[os.path.basename(name)] if ("/" + path).endswith(suffix)]
        return matches[0] if len(matches) == 1 else None

    def includes(self, path):
        """[(line, include as written, tree path)] of one file; external headers left out."""
        if path not in self.includes_of:
            found = []
            try:
                for number, written in quoted_includes(os.path.join(self.root, path)):
                    resolved = self.resolve(path, written)
                    if resolved:
                        found.append((number, written, resolved))
            except OSError:
                pass  # a generated source: nothing of ours to read
            self.includes_of[path] = found
        return self.includes_of[path]

    def libraries_included(self, target, starts):
        """{library: first (file, line, include)} that `starts` and the headers of no library
        (or of `target` itself) they reach include."""
        used, seen, queue = {}, set(starts), list(starts)
        while queue:
            path = queue.pop(0)
            for number, written, resolved in self.includes(path):
                owner = self.owner(resolved)
                if owner is not None and owner != target:
                    used.setdefault(owner, (path, number, written))
                elif resolved not in seen:
                    seen.add(resolved)
                    queue.append(resolved)
        return used


def named(item, targets):
    """A link item as the target it names (an alias kvshare::X is X), or None if not ours."""
    link_only = LINK_ONLY.match(item)
    if link_only:
        item = link_only.group(1)
    if item.startswith("kvshare::") and item[len("kvshare::"):] in targets:
        item = item[len("kvshare::"):]
    return item if item in targets and targets[item]["type"].endswith("_LIBRARY") else None


def check(root, targets):
    tree = Tree(root, targets)
    broken, links_checked = [], 0
    for name in sorted(targets):
        target = targets[name]
        where = "%s/CMakeLists.txt" % target["folder"] if target["folder"] != "." else "CMakeLists.txt"
        links = {named(item, targets) for item in target["links"]} - {None}
        public = {named(item, targets) for item in target["interface_links"] if not LINK_ONLY.match(item)} - {None}
        links_checked += len(links)
        headers = sorted(path for path in tree.files if path.endswith(HEADER_SUFFIXES) and tree.owner(path) == name)
        sources = [source for source in target["sources"] if source in tree.files]
        if target["sources"] and not sources:
            fail("none of %s's sources (%s) is in %s: is --root the tree the build was configured from?" %
                 (name, target["sources"][0], root))
        used = tree.libraries_included(name, sources + headers)
        for library in sorted(set(used) - links):
            path, number, written = used[library]
            broken.append("%s:%d: #include \"%s\" is %s's, but %s does not link %s: add it to %s's links in %s" %
                          (path, number, written, library, name, library, name, where))
        for library in sorted(links - set(used)):
            broken.append("%s links %s but includes none of its headers: take it out of %s's links in %s (what a "
                          "library it includes needs, that library links itself)" % (name, library, name, where))
        if name not in tree.libraries:
            continue
        needed_public = tree.libraries_included(name, headers)
        for library in sorted(set(needed_public) - public):
            path, number, written = needed_public[library]
            broken.append("%s:%d: #include \"%s\": %s's header includes %s, so %s must link it PUBLIC in %s" %
                          (path, number, written, name, library, name, where))
        for library in sorted((public & links & set(used)) - set(needed_public)):
            broken.append("%s links %s PUBLIC but none of its headers includes it: make it PRIVATE in %s" %
                          (name, library, where))
    return broken, links_checked


def main():
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=here)
    parser.add_argument("manifest")
    args = parser.parse_args()
    targets = read_manifest(args.manifest)
    broken, links_checked = check(args.root, targets)
    for line in broken:
        print("check-links: " + line, file=sys.stderr)
    if broken:
        print("check-links: %d link(s) differ from what the targets include (docs/layers.md)" % len(broken),
              file=sys.stderr)
        return 1
    print("check-links: %d targets, %d links, each one what its target includes" % (len(targets), links_checked))
    return 0


if __name__ == "__main__":
    sys.exit(main())
