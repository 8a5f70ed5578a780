"""YAML as the configs and hardware files are read: PyYAML's safe loader, refusing a key given
twice in one mapping (YAML keeps the last silently)."""

from __future__ import annotations

import yaml


class DuplicateKey(yaml.YAMLError):
    """A key given twice in one mapping; its message names both lines."""


class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping: YAML keeps the last one
    silently, so `cutoff_len` written twice would train with whichever came last."""

    def construct_mapping(self, node, deep=False):
        first: dict = {}
        if any(k.tag == "tag:yaml.org,2002:merge" for k, _ in node.value):
            return super().construct_mapping(node, deep=deep)  # `<<: *base` then a key overrides it, on purpose
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                seen = key in first
            except TypeError:  # an unhashable key: PyYAML's own error follows
                continue
            if seen:
                raise DuplicateKey(f"line {line}: key {key!r} is given twice (first at line {first[key]}; YAML "
                                    "would keep the last silently): keep one")
            first[key] = line
        return super().construct_mapping(node, deep=deep)
