"""YAML as modelops reads its files (manifests, regions): a key given twice is an error, never
"the last one wins"."""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["UniqueKeyLoader", "load_unique"]


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML loader that refuses a key given twice (the last one would silently win) and keeps an
    unquoted integer ``version`` as written: YAML 1.1 reads ``010`` as 8 and ``0x1F`` as 31."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor`: merged below, where the mapping's own keys win (YAML 1.1 merge)
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
            if key == "version" and isinstance(value_node, yaml.ScalarNode) and \
                    value_node.tag == "tag:yaml.org,2002:int":
                value_node.tag = "tag:yaml.org,2002:str"  # the digits as written, not the number they encode
        self.flatten_mapping(node)
        return super().construct_mapping(node, deep)


def load_unique(text: str, name: str) -> Any:
    """The one YAML document in ``text``, read by :class:`UniqueKeyLoader`.

    Args:
        name: the file's path, which the loader's errors name (not "<unicode string>").

    Raises:
        yaml.YAMLError: not YAML, or a key given twice in one mapping (with its line and column).
    """
    loader = UniqueKeyLoader(text)  # noqa: S506 - a SafeLoader subclass
    loader.name = name
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
