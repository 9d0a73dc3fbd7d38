"""Which vLLM attributes and call keywords a backend uses, and whether a vLLM release has them.

Import checks (:mod:`modelops.vllm_symbols`) see a class that still exists; a backend can still
fail at model load when it reads an attribute or passes a keyword that the chosen vLLM removed
or renamed. This module carries the check one level further, statically, with :mod:`ast`:

- :func:`uses_of_source` lists a backend file's uses of what it imports from vLLM:
  ``Class.attr`` / ``func.attr`` reads, calls' keywords (``Class(kw=)``, ``Class.method(kw=)``,
  ``func(kw=)``), and attributes and method keywords on *instances*, where the instance's class
  is plain from the code: ``x = Class(...)``, ``x = Class.from_*(...)`` (a classmethod
  constructor), ``with Class(...) as x``, the same for ``self.x``.
- :func:`api_index` reads, from a vLLM source tree's modules, each class's members (class-body
  names, methods, properties, dataclass/msgspec/pydantic fields, ``self.x`` set in any method,
  through its bases within vLLM) and each function's keywords.
- :func:`check_uses` says, per use, whether that vLLM has it and, when not, what it has that
  looks alike (:func:`difflib.get_close_matches`).

What it cannot see, and so accepts: names reached through ``getattr(obj, "name")``; objects
whose class the code does not name (a function's return value, a parameter); classes with a
``__getattr__`` or with a base outside vLLM other than plain ones (``ABC``, ``Enum``,
``msgspec.Struct``, ...) such as ``torch.nn.Module``; C extensions (``vllm._C``); uses inside
``try`` blocks that catch ``AttributeError``, ``TypeError`` or ``ImportError`` (the backend
handles their absence).

Use strings: ``module:Name.attr``, ``module:Name.method(kw=)``, ``module:Name(kw=)``.
"""

from __future__ import annotations

import ast
import difflib
import warnings
from dataclasses import dataclass

__all__ = ["Use", "api_index", "check_uses", "modules_referenced", "parse_release_source", "uses_of_source"]

# Bases from outside vLLM that add no attribute a backend would use: a class built on them
# is as closed as its own body says.
_PLAIN_BASES = {"object", "ABC", "Generic", "Protocol", "Enum", "IntEnum", "StrEnum", "Flag", "IntFlag", "str",
                "int", "Exception", "RuntimeError", "ValueError", "NamedTuple", "TypedDict", "Struct"}
_FIELD_BASES = {"Struct", "BaseModel", "NamedTuple", "TypedDict"}  # constructors take the annotated fields
_OPTIONAL_ERRORS = {"AttributeError", "TypeError", "ImportError", "ModuleNotFoundError"}


@dataclass(frozen=True)
class Use:
    """One use of a vLLM name by a backend.

    Attributes:
        spec: the imported name, ``module:Name`` (``a:X|b:X`` where the backend tries ``a``
            first and falls back to ``b``: the first that the vLLM release has is judged); member: the attribute or method read on it
            (``""`` for a call of ``Name`` itself); keyword: the call keyword, or ``""``;
        instance: True when ``member`` is read on an instance of ``Name`` (instance attributes
            count); where: ``file:line`` in the backend.
    """

    spec: str
    member: str = ""
    keyword: str = ""
    instance: bool = False
    where: str = ""

    @property
    def key(self) -> str:
        """The use without its location: ``module:Name.member(kw=)``."""
        text = self.spec + (f".{self.member}" if self.member else "")
        return text + (f"(kw={self.keyword})" if self.keyword else "") + ("@instance" if self.instance else "")

    def __str__(self) -> str:
        return f"{self.where}: {self.key.replace('@instance', '')}"

    @classmethod
    def parse(cls, text: str) -> Use:
        """The inverse of ``f"{use.where} {use.key}"`` (the committed data's form).

        Raises:
            ValueError: not that form.
        """
        where, _, key = text.rpartition(" ")
        instance = key.endswith("@instance")
        key = key.removesuffix("@instance")
        keyword = ""
        if key.endswith(")"):
            key, _, kw = key[:-1].partition("(kw=")
            keyword = kw
        alternatives, _, last = key.rpartition("|")
        module, colon, rest = last.partition(":")
        if not colon or not rest:
            raise ValueError(f"not a vLLM use: {text!r}")
        name, _, member = rest.partition(".")
        spec = (alternatives + "|" if alternatives else "") + f"{module}:{name}"
        return cls(spec, member, keyword, instance, where)


# -- what a backend uses -----------------------------------------------------------------------


def _optional_nodes(tree: ast.AST) -> set[int]:
    optional: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try):
            caught = set()
            for h in node.handlers:
                types = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
                caught |= {t.id for t in types if isinstance(t, ast.Name)}
            if caught & _OPTIONAL_ERRORS:
                optional.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return optional


def _vllm_imports(tree: ast.AST, prefix: str) -> dict[str, str]:
    """``{local name: spec}``; a name bound by several imports (``try: from a import X`` /
    ``except ImportError: from b import X``) maps to ``"a:X|b:X"``, in the order they are tried."""
    names: dict[str, list[str]] = {}
    for node in _in_order(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and \
                (node.module == prefix or node.module.startswith(prefix + ".")):
            for a in node.names:
                specs = names.setdefault(a.asname or a.name, [])
                if f"{node.module}:{a.name}" not in specs:
                    specs.append(f"{node.module}:{a.name}")
    return {name: "|".join(specs) for name, specs in names.items()}


def _in_order(tree: ast.AST):
    """Every node, depth first in source order (a try body's imports before its handler's)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _target_key(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return f"self.{node.attr}"
    return None


def _bindings(node: ast.AST) -> list[ast.AST]:
    """The name targets a statement or argument list binds (not imports)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        a = node.args
        return [ast.Name(id=p.arg) for p in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if p]
    if isinstance(node, ast.Assign):
        return list(node.targets)
    if isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor, ast.NamedExpr)):
        return [node.target]
    if isinstance(node, ast.comprehension):
        return [node.target]
    if isinstance(node, ast.withitem) and node.optional_vars is not None:
        return [node.optional_vars]
    return []


def _flat(targets: list[ast.AST]) -> list[ast.AST]:
    out = []
    for t in targets:
        if isinstance(t, (ast.Tuple, ast.List)):
            out += _flat(list(t.elts))
        elif isinstance(t, ast.Starred):
            out += _flat([t.value])
        else:
            out.append(t)
    return out


def uses_of_source(source: str, filename: str, prefix: str = "vllm") -> list[Use]:
    """The uses of ``prefix``'s names in Python ``source`` (see the module docstring), sorted.

    A name is followed only where it cannot mean anything else: an imported name not re-bound
    in the scope (a parameter, an assignment) and an instance variable (``x`` in a function,
    ``self.x`` in a class) every assignment of which makes an instance of the same class;
    attributes the backend itself sets on such an instance are not uses.

    Args:
        source: a backend file's text; filename: how ``where`` names it (``src/model.py``).

    Raises:
        SyntaxError: ``source`` does not parse (naming ``filename``).
    """
    tree = ast.parse(source, filename=filename)
    imported = _vllm_imports(tree, prefix)
    optional = _optional_nodes(tree)
    # node → its function (or the module; locals are per function) and its class (self.x are per class)
    scope_of: dict[int, int] = {}
    class_of: dict[int, int] = {}
    for scope in ast.walk(tree):
        if isinstance(scope, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack = list(ast.iter_child_nodes(scope))
            while stack:
                node = stack.pop()
                if isinstance(scope, ast.ClassDef):
                    class_of[id(node)] = id(scope)
                else:
                    scope_of[id(node)] = id(scope)
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    scope_of.setdefault(id(node), id(scope))  # its name and defaults live outside
                    continue
                if not isinstance(node, ast.ClassDef):
                    stack.extend(ast.iter_child_nodes(node))
    for scope in ast.walk(tree):  # a function inside a class: its nodes belong to that class
        if isinstance(scope, ast.ClassDef):
            for node in ast.walk(scope):
                class_of.setdefault(id(node), id(scope))

    def key_of(node: ast.AST, scope: ast.AST | None = None) -> tuple | None:
        key = _target_key(node)
        if key is None:
            return None
        if key.startswith("self."):
            return (class_of.get(id(node)), key)
        return (id(scope) if scope is not None else scope_of.get(id(node)), key)

    # Bindings other than the vLLM imports: a re-bound import name means something else in its
    # scope; an instance variable assigned anything but one class's instance is not followed.
    shadowed: set[tuple] = set()
    made: dict[tuple, set[str | None]] = {}

    def instance_of(value: ast.AST | None) -> str | None:
        if isinstance(value, ast.Await):
            value = value.value
        if not isinstance(value, ast.Call):
            return None
        func = value.func
        if isinstance(func, ast.Name) and func.id in imported:
            return imported[func.id]
        if isinstance(func, ast.Attribute) and func.attr.startswith("from_") and \
                isinstance(func.value, ast.Name) and func.value.id in imported:
            return imported[func.value.id]
        return None

    for node in ast.walk(tree):
        for target in _flat(_bindings(node)):
            scope = node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) else None
            key = key_of(target, scope) if scope is None else (id(scope), target.id)
            if key is None:
                continue
            shadowed.add(key)
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and \
                len(_flat(_bindings(node))) == 1 else node.context_expr if isinstance(node, ast.withitem) else None
            if not (isinstance(value, ast.Constant) and value.value is None):  # `x = None` resets, keeps the class
                made.setdefault(key, set()).add(instance_of(value))
    objects = {key: (specs.pop(), True) for key, specs in made.items() if len(specs) == 1 and None not in specs}
    module_id = id(tree)
    set_on = {(key_of(n.value), n.attr) for n in ast.walk(tree)
              if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and key_of(n.value) in objects}

    def lookup(node: ast.AST) -> tuple[str, bool] | None:
        key = key_of(node)
        if key is None:
            return None
        if key in objects:
            return objects[key]
        name = key[1]
        if name in imported and key not in shadowed and (module_id, name) not in shadowed:
            return imported[name], False
        return None

    found: set[Use] = set()

    def add(node: ast.AST, **kw) -> None:
        if id(node) not in optional:
            found.add(Use(where=f"{filename}:{node.lineno}", **kw))

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            held = lookup(node.value)
            if held and (key_of(node.value), node.attr) not in set_on:
                add(node, spec=held[0], member=node.attr, instance=held[1])
        elif isinstance(node, ast.Call):
            func, keywords = node.func, [k.arg for k in node.keywords if k.arg]
            held = lookup(func)
            if held and not held[1]:
                for kw in keywords:
                    add(node, spec=held[0], keyword=kw)
            elif isinstance(func, ast.Attribute) and (held := lookup(func.value)):
                for kw in keywords:
                    add(node, spec=held[0], member=func.attr, keyword=kw, instance=held[1])
    return sorted(found, key=lambda u: (u.key, u.where))


# -- what a vLLM release defines ----------------------------------------------------------------


def parse_release_source(source: bytes) -> ast.Module:
    """:func:`ast.parse` of a vLLM release's file, quiet about the invalid escapes old releases
    have (SyntaxWarning). Raises SyntaxError or ValueError as :func:`ast.parse` does."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return ast.parse(source)


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = fn.args
    names = [p.arg for p in a.args + a.kwonlyargs]
    return names + (["**"] if a.kwarg else [])


def _decorator_names(node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    out = set()
    for d in node.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        out.add(d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", ""))
    return out


def _resolve_relative(module: str, is_package: bool, node: ast.ImportFrom) -> str | None:
    if node.level == 0:
        return node.module
    parts = module.split(".") if is_package else module.split(".")[:-1]
    if node.level > 1:
        parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else [])) or None


def _module_imports(tree: ast.Module, module: str, is_package: bool) -> dict[str, str]:
    """``{name: "vllm.x:Name"}`` a module re-exports: its module-level ``from`` imports (also
    under ``if``/``try``, e.g. ``if TYPE_CHECKING:``) and lazy maps like vLLM's own
    ``MODULE_ATTRS = {"LLM": ".entrypoints.llm:LLM"}`` read by a module ``__getattr__``."""
    imports: dict[str, str] = {}

    def vllm(target: str | None) -> bool:
        return bool(target) and (target == "vllm" or target.startswith("vllm."))

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.ImportFrom):
                target = _resolve_relative(module, is_package, node)
                if vllm(target):
                    imports.update({a.asname or a.name: f"{target}:{a.name}" for a in node.names if a.name != "*"})
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body + node.orelse + [s for h in getattr(node, "handlers", []) for s in h.body])
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict):
                for k, v in zip(node.value.keys, node.value.values):
                    if isinstance(k, ast.Constant) and isinstance(v, ast.Constant) and isinstance(v.value, str) \
                            and isinstance(k.value, str) and v.value.count(":") == 1:
                        path, _, name = v.value.partition(":")
                        level = len(path) - len(path.lstrip("."))
                        rel = ast.ImportFrom(module=path.lstrip(".") or None, names=[], level=level)
                        target = _resolve_relative(module, is_package, rel)
                        if vllm(target) and name.isidentifier():
                            imports.setdefault(k.value, f"{target}:{name}")

    visit(tree.body)
    return imports


def _class_record(node: ast.ClassDef, imports: dict[str, str], module: str, local: set[str]) -> dict:
    members, fields, methods = set(), [], {}
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            members.add(stmt.name)
            if "property" not in _decorator_names(stmt) and not stmt.name.endswith("setter"):
                methods[stmt.name] = _params(stmt)[1:] if "staticmethod" not in _decorator_names(stmt) \
                    else _params(stmt)
            for sub in ast.walk(stmt):  # self.x = ... in any method: an instance attribute
                targets = sub.targets if isinstance(sub, ast.Assign) else \
                    [sub.target] if isinstance(sub, (ast.AnnAssign, ast.AugAssign)) else []
                for t in targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        members.add(t.attr)
        elif isinstance(stmt, ast.ClassDef):
            members.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            members.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            members.add(stmt.target.id)
            if "ClassVar" not in ast.unparse(stmt.annotation):
                fields.append(stmt.target.id)
    bases = []
    for b in node.bases:
        text = ast.unparse(b.value if isinstance(b, ast.Subscript) else b)
        head, _, attr = text.partition(".")
        if head in imports and not attr:
            bases.append(imports[head])
        elif head in imports:  # module.Class through `import vllm.x as m` is rare; treat as outside
            bases.append("?" + text)
        elif text in local:
            bases.append(f"{module}:{text}")
        else:
            bases.append("?" + text.rpartition(".")[2])
    return {"bases": bases, "members": sorted(members), "fields": fields, "methods": methods,
            "dataclass": bool({"dataclass", "config", "pydantic_dataclass"} & _decorator_names(node))}


def api_index(modules: dict[str, tuple[bytes, bool]]) -> dict[str, dict]:
    """Classes, functions and re-exports of vLLM modules.

    Args:
        modules: ``{module: (source bytes, is_package)}``, e.g. from an sdist.

    Returns:
        ``{module: {"classes": {Name: {bases, members, fields, methods: {name: [keywords]},
        dataclass}}, "functions": {name: [keywords]}, "imports": {local name: "module:Name"}}}``;
        keyword lists end with ``"**"`` where the callable takes ``**kwargs``; a base outside
        vLLM is ``"?Name"``. Files that do not parse are left out (their names count as unknown).
    """
    out: dict[str, dict] = {}
    for module, (source, is_package) in modules.items():
        try:
            tree = parse_release_source(source)
        except (SyntaxError, ValueError):
            continue
        imports = _module_imports(tree, module, is_package)
        local = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
        classes = {n.name: _class_record(n, imports, module, local) for n in tree.body if isinstance(n, ast.ClassDef)}
        functions = {n.name: _params(n) for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        out[module] = {"classes": classes, "functions": functions, "imports": imports}
    return out


def modules_referenced(api: dict[str, dict]) -> set[str]:
    """Modules that ``api``'s classes' bases come from and ``api`` lacks (what to read next when
    an index is built from part of a release)."""
    refs = {b for entry in api.values() for c in entry["classes"].values() for b in c["bases"] if ":" in b}
    return {spec.partition(":")[0] for spec in refs} - set(api)


# -- the check ------------------------------------------------------------------------------------


@dataclass
class _Resolved:
    members: set[str] | None  # None: open (cannot tell)
    init: list[str] | None  # keywords of the constructor; None: cannot tell
    methods: dict[str, list[str]]
    fields: list[str]
    field_based: bool


def _lookup(spec: str, index: dict[str, dict], depth: int = 0) -> tuple[str, dict | None, str]:
    """(kind, record, qualified spec): kind is "class", "function", "absent" or "unknown"."""
    module, _, name = spec.partition(":")
    entry = index.get(module)
    if entry is None or depth > 8:
        return "unknown", None, spec
    if name in entry["classes"]:
        return "class", entry["classes"][name], spec
    if name in entry["functions"]:
        return "function", {"params": entry["functions"][name]}, spec
    if name in entry["imports"]:
        return _lookup(entry["imports"][name], index, depth + 1)
    return "unknown", None, spec  # bound some other way (assignment, lazy __getattr__)


def _resolve_class(record: dict, index: dict[str, dict], seen: frozenset = frozenset()) -> _Resolved:
    members, methods = set(record["members"]), dict(record["methods"])
    open_ = "__getattr__" in members or "__getattribute__" in members
    fields, field_based = list(record["fields"]), record["dataclass"]
    parent_init: list[str] | None = None
    for base in record["bases"]:
        if base.startswith("?"):  # outside vLLM
            field_based |= base[1:] in _FIELD_BASES
            open_ |= base[1:] not in _PLAIN_BASES
            continue
        kind, rec, qualified = _lookup(base, index)
        if kind != "class" or qualified in seen:
            open_ = True
            continue
        parent = _resolve_class(rec, index, seen | {qualified})
        open_ |= parent.members is None
        members |= parent.members or set()
        for name, params in parent.methods.items():
            methods.setdefault(name, params)
        fields = parent.fields + fields
        field_based |= parent.field_based
        if parent_init is None:
            parent_init = parent.init
    # The constructor: an __init__ of its own, else the generated one of a dataclass-like
    # class (its fields, bases' first), else the first base's.
    if "__init__" in record["methods"]:
        init = record["methods"]["__init__"]
    elif field_based:
        init = fields
    else:
        init = parent_init if parent_init is not None or open_ else []
    return _Resolved(None if open_ else members, init, methods, fields, field_based)


def _near(word: str, choices: set[str] | list[str]) -> str:
    close = difflib.get_close_matches(word, sorted(c for c in choices if c != "**"), n=3, cutoff=0.6)
    return f"; it has {', '.join(close)}" if close else ""


def check_uses(uses: list[Use], index: dict[str, dict]) -> dict[str, str | None]:
    """``{use.key: None (resolves or cannot be told) | reason}`` against an :func:`api_index`.

    A use of a name the index does not have (a missing import) is not judged here: the import
    check reports it.
    """
    verdicts: dict[str, str | None] = {}
    for use in uses:
        if use.key in verdicts:
            continue
        verdicts[use.key] = _verdict(use, index)
    return verdicts


def _verdict(use: Use, index: dict[str, dict]) -> str | None:
    for spec in use.spec.split("|"):  # the import the backend gets on this release
        kind, record, _ = _lookup(spec, index)
        if kind != "unknown" or spec.partition(":")[0] in index:
            break
    name = spec.partition(":")[2]
    if kind == "function":
        params = record["params"]
        if use.keyword and not use.member and "**" not in params and use.keyword not in params:
            return f"{name}() takes no keyword {use.keyword!r}{_near(use.keyword, params)}"
        return None
    if kind != "class":
        return None
    cls = _resolve_class(record, index)
    if use.member:
        dunder = use.member.startswith("__") and use.member.endswith("__")  # type machinery
        if cls.members is not None and use.member not in cls.members and not dunder:
            return f"{name} has no attribute {use.member!r}{_near(use.member, cls.members)}"
        params = cls.methods.get(use.member)
        if use.keyword and params is not None and "**" not in params and use.keyword not in params:
            return f"{name}.{use.member}() takes no keyword {use.keyword!r}{_near(use.keyword, params)}"
        return None
    if use.keyword and cls.init is not None and "**" not in cls.init and use.keyword not in cls.init:
        return f"{name}() takes no keyword {use.keyword!r}{_near(use.keyword, cls.init)}"
    return None
