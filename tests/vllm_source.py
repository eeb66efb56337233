"""vLLM's source read as text, never imported: the installed vLLM's, or a published wheel's.

- ``fetch``: a release's wheel from the package index, kept in ``.cache/vllm-wheels`` (git-ignored).
  ``make setup-dev`` fetches the ones the tests read (``python -m tests.vllm_source``).
- ``classes``: a module's classes as ``ast`` sees them: bases, methods with their parameters,
  what each sets and reads on ``self``.
- ``connector_problems``: where decodebench's connector classes do not fit a vLLM's connector
  classes (abstract methods, hook signatures, hooks that stopped being hooks, vLLM attributes
  read, a skipped constructor).
- ``has_attribute``: whether a vLLM class (a scheduler output, a request) still has a field.
- ``bench_serve_flags``: ``vllm bench serve``'s flags and their literal defaults, as its
  ``add_cli_args`` adds them.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "vllm-wheels"
# The release next to the installed one (0.32): the connector and the CLI are held to it.
NEXT = "0.33.0"
# One platform's wheel, whatever the machine: the Python sources read are the same in all.
PLATFORM = "manylinux_2_28_x86_64"

BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
DECODE_BENCH = "vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector"
CONNECTOR_MODULES = (BASE, DECODE_BENCH)
OUR_MODULES = ("connector.facade", "connector.scheduler", "connector.worker", "connector.metadata")

# A module's source by its dotted name.
Sources = Callable[[str], str]


# --- where the source comes from ----------------------------------------------------------------


def cached(version: str) -> Path | None:
    """The cached wheel of vLLM ``version``, if it was fetched."""
    return next(iter(sorted(CACHE.glob(f"vllm-{version}-*.whl"))), None)


def fetch(version: str = NEXT) -> Path:
    """vLLM ``version``'s wheel, from the cache or else from the package index (``pip download``)."""
    found = cached(version)
    if found is not None:
        return found
    CACHE.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps",
               "--only-binary=:all:", "--platform", PLATFORM, "--quiet", "--dest"]
    # Into a temporary folder first: a fetch cut short never leaves a wheel that looks whole.
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        done = subprocess.run([*command, tmp], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            raise RuntimeError(
                f"could not fetch vLLM {version}'s wheel from the package index into {CACHE} "
                f"({' '.join(command)} DIR exited {done.returncode}: {done.stderr.strip()[-1500:]}); "
                "`make setup-dev` fetches it, and it needs the package index")
        target = CACHE / wheels[0].name
        os.replace(wheels[0], target)
    return target


class Wheel:
    """The Python sources of a wheel, by module name."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._zip = zipfile.ZipFile(path)

    def __call__(self, module: str) -> str:
        return self._zip.read(module.replace(".", "/") + ".py").decode()


def installed(module: str) -> str:
    """The installed package's source of ``module``, read from its file (nothing imported)."""
    top, _, rest = module.partition(".")
    spec = importlib.util.find_spec(top)
    assert spec is not None and spec.submodule_search_locations, f"{top} is not installed"
    root = Path(next(iter(spec.submodule_search_locations)))
    path = root.joinpath(*rest.split(".")).with_suffix(".py") if rest else root / "__init__.py"
    return path.read_text()


def ours(module: str) -> str:
    """This checkout's source of ``module``."""
    return REPO.joinpath(*module.split(".")).with_suffix(".py").read_text()


# --- classes as ast sees them ---------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    """A method's parameters in order (``*args``, ``**kwargs``, ``*`` and ``/`` as written)."""

    name: str
    params: tuple[str, ...]
    kind: str  # "method", "property", "classmethod" or "staticmethod"
    abstract: bool

    def shown(self) -> str:
        prefix = "" if self.kind == "method" else f"@{self.kind} "
        return f"{prefix}{self.name}({', '.join(self.params)})"


@dataclass
class ClassInfo:
    """What one class declares."""

    name: str
    module: str
    bases: tuple[str, ...]
    methods: dict[str, Method] = field(default_factory=dict)
    # Names bound in the class body (dataclass fields, constants).
    fields: set[str] = field(default_factory=set)
    # ``self.X`` stored anywhere in its methods, in ``__init__``, and read anywhere.
    sets: set[str] = field(default_factory=set)
    init_sets: set[str] = field(default_factory=set)
    reads: set[str] = field(default_factory=set)
    # Classes whose ``__init__`` its own ``__init__`` calls by name (``Base.__init__(self, ...)``);
    # ``super`` when it calls ``super().__init__``.
    init_calls: tuple[str, ...] = ()

    @property
    def vllm(self) -> bool:
        return self.module.startswith("vllm.")


def _params(args: ast.arguments) -> tuple[str, ...]:
    out = [a.arg for a in args.posonlyargs]
    if args.posonlyargs:
        out.append("/")
    out += [a.arg for a in args.args]
    if args.vararg is not None:
        out.append(f"*{args.vararg.arg}")
    elif args.kwonlyargs:
        out.append("*")
    out += [a.arg for a in args.kwonlyargs]
    if args.kwarg is not None:
        out.append(f"**{args.kwarg.arg}")
    return tuple(out)


def _decorator_name(node: ast.expr) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _method(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Method:
    names = [_decorator_name(d) for d in fn.decorator_list]
    kind = next((k for k in ("classmethod", "staticmethod") if k in names), "method")
    if "property" in names or "cached_property" in names:
        kind = "property"
    return Method(fn.name, _params(fn.args), kind, "abstractmethod" in names)


def _self_attributes(fn: ast.AST) -> tuple[set[str], set[str]]:
    """Attributes of ``self`` that ``fn`` stores and reads."""
    stored: set[str] = set()
    read: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            (stored if isinstance(node.ctx, ast.Store | ast.Del) else read).add(node.attr)
    return stored, read


def _init_calls(fn: ast.AST) -> tuple[str, ...]:
    calls: list[str] = []
    for node in ast.walk(fn):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "__init__"):
            continue
        owner = node.func.value
        if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
            calls.append("super")
        elif isinstance(owner, ast.Name):
            calls.append(owner.id)
    return tuple(calls)


def classes(source: str, module: str) -> dict[str, ClassInfo]:
    """Every top-level class of ``source`` (the module ``module``), by name."""
    found: dict[str, ClassInfo] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        bases = tuple(b.attr if isinstance(b, ast.Attribute) else b.id
                      for b in node.bases if isinstance(b, ast.Attribute | ast.Name))
        info = ClassInfo(node.name, module, bases)
        for item in node.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                # A property's setter repeats its name: the getter is the declaration.
                info.methods.setdefault(item.name, _method(item))
                stored, read = _self_attributes(item)
                info.sets |= stored
                info.reads |= read
                if item.name == "__init__":
                    info.init_sets |= stored
                    info.init_calls = _init_calls(item)
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                info.fields.add(item.target.id)
            elif isinstance(item, ast.Assign):
                info.fields |= {t.id for t in item.targets if isinstance(t, ast.Name)}
        found[node.name] = info
    return found


def gather(modules: Mapping[str, str]) -> dict[str, ClassInfo]:
    """The classes of several modules (module name -> source), by name."""
    found: dict[str, ClassInfo] = {}
    for module, source in modules.items():
        found.update(classes(source, module))
    return found


def mro(name: str, known: Mapping[str, ClassInfo]) -> list[ClassInfo]:
    """``name``'s method resolution order (C3) over the classes in ``known``; others are left out."""

    def linear(cls: str) -> list[str]:
        bases = [b for b in known[cls].bases if b in known]
        pending = [linear(b) for b in bases] + [bases]
        out = [cls]
        while any(pending):
            for seq in pending:
                head = seq[0] if seq else None
                if head is not None and not any(head in s[1:] for s in pending):
                    break
            else:
                raise ValueError(f"no consistent method order for {cls}")
            out.append(head)
            pending = [s[1:] if s and s[0] == head else s for s in pending]
        return out

    return [known[c] for c in linear(name)]


def has_attribute(known: Mapping[str, ClassInfo], cls: str, attribute: str) -> bool:
    """Whether instances of ``cls`` have ``attribute``: a field, a method or property, or one
    its methods store on ``self``, on it or a base class in ``known``."""
    return any(attribute in c.fields or attribute in c.methods or attribute in c.sets
               for c in mro(cls, known))


# --- the connector against a vLLM -----------------------------------------------------------------


def overrides(cls: ClassInfo, line: list[ClassInfo]) -> dict[str, list[ClassInfo]]:
    """Each method of ``cls`` that a vLLM class of its ``line`` (its mro) defines, with those."""
    return {name: [v for v in line if v.vllm and name in v.methods]
            for name in cls.methods if any(v.vllm and name in v.methods for v in line)}


def connector_problems(
    our_sources: Mapping[str, str], vllm: Sources, version: str,
    before: Sources | None = None, before_version: str = "",
) -> list[str]:
    """Where the connector's classes in ``our_sources`` (module -> source) do not fit the
    connector classes of ``vllm``, release ``version``; ``before`` is a release they fit,
    whose hooks must still be hooks in ``version``. Empty when they fit."""
    now = gather({**{m: vllm(m) for m in CONNECTOR_MODULES}, **our_sources})
    then = gather({**{m: before(m) for m in CONNECTOR_MODULES}, **our_sources}) if before else None
    problems: list[str] = []
    for cls in (c for c in now.values() if not c.vllm):
        line = mro(cls.name, now)
        if not any(c.vllm for c in line):
            continue
        # Abstract methods: the first definition along the mro must be a real one.
        abstract = {n for c in line if c.vllm for n, m in c.methods.items() if m.abstract}
        for name in sorted(abstract):
            first = next(c for c in line if name in c.methods)
            if first.methods[name].abstract:
                problems.append(f"{cls.name} does not implement {name}, abstract in vLLM {version}'s "
                                f"{first.name}")
        # Hooks: the parameters (names, order) and kind of every vLLM definition it overrides.
        for name, defined in overrides(cls, line).items():
            mine = cls.methods[name]
            for theirs in defined:
                their = theirs.methods[name]
                if (mine.params, mine.kind) != (their.params, their.kind):
                    problems.append(f"{cls.name}.{mine.shown()} does not match vLLM {version}'s "
                                    f"{theirs.name}.{their.shown()}")
        # Hooks of the release before that are no hooks now: vLLM would never call them.
        if then is not None:
            for name, defined in overrides(cls, mro(cls.name, then)).items():
                if not any(name in c.methods for c in line if c.vllm):
                    problems.append(f"{cls.name}.{name} overrides vLLM {before_version}'s "
                                    f"{defined[0].name}.{name}, which vLLM {version} no longer has")
        # Attributes read on self that nothing along the mro declares or stores.
        for attribute in sorted(cls.reads):
            if not any(attribute in c.fields or attribute in c.methods or attribute in c.sets
                       for c in line):
                problems.append(f"{cls.name} reads self.{attribute}, which no class of vLLM "
                                f"{version} it builds on sets")
        problems += _skipped_constructors(cls, line, version)
    return problems


def _skipped_constructors(cls: ClassInfo, line: list[ClassInfo], version: str) -> list[str]:
    """What the ``__init__`` of a vLLM class skipped by ``cls.__init__`` sets that it does not."""
    if "__init__" not in cls.methods or "super" in cls.init_calls:
        return []
    called = [i for i, c in enumerate(line) if c.name in cls.init_calls]
    if not called:
        return []
    skipped = [c for c in line[1:called[0]] if c.vllm and "__init__" in c.methods]
    # What the __init__ chain that does run sets: cls's own and those from the one it calls on.
    runs = set(cls.init_sets).union(*(c.init_sets for c in line[called[0]:]))
    problems = []
    for c in skipped:
        for attribute in sorted(c.init_sets - runs):
            problems.append(f"{cls.name}.__init__ skips vLLM {version}'s {c.name}.__init__, "
                            f"which sets self.{attribute}; {cls.name}.__init__ does not")
    return problems


# --- vllm bench serve's flags ----------------------------------------------------------------------

# Where ``vllm bench serve``'s ``add_cli_args`` and the functions it calls are.
SERVE_MODULES = ("vllm.benchmarks.serve", "vllm.benchmarks.datasets.datasets")


class NotLiteral:
    """A default that is an expression this reader does not evaluate (compared with nothing)."""

    def __repr__(self) -> str:
        return "<not a literal>"


NOT_LITERAL = NotLiteral()


def _constants(tree: ast.Module) -> dict[str, object]:
    """Literal constants of a module: ``NAME = 1`` at the top, ``Class.NAME = 1`` in a class."""
    found: dict[str, object] = {}

    def take(prefix: str, body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef) and not prefix:
                take(f"{node.name}.", node.body)
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            for target in targets:
                if isinstance(target, ast.Name):
                    with contextlib.suppress(ValueError, TypeError):
                        found[prefix + target.id] = ast.literal_eval(value)

    take("", tree.body)
    return found


def _value(node: ast.expr, constants: Mapping[str, object]) -> object:
    """A literal, a named constant, or ``float("inf")``-like call on one; else ``NOT_LITERAL``."""
    with contextlib.suppress(ValueError, TypeError):
        return ast.literal_eval(node)
    if isinstance(node, ast.Name):
        return constants.get(node.id, NOT_LITERAL)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return constants.get(f"{node.value.id}.{node.attr}", NOT_LITERAL)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("float", "int") and len(node.args) == 1 and not node.keywords):
        arg = _value(node.args[0], constants)
        if isinstance(arg, str | int | float):
            return float(arg) if node.func.id == "float" else int(arg)
    return NOT_LITERAL


def _default(call: ast.Call, constants: Mapping[str, object]) -> object:
    """The default argparse gives the flag ``call`` adds."""
    keywords = {k.arg: k.value for k in call.keywords if k.arg}
    if "default" in keywords:
        return _value(keywords["default"], constants)
    action = keywords.get("action")
    if isinstance(action, ast.Constant):
        return {"store_true": False, "store_false": True}.get(action.value)
    return None


def bench_serve_flags(source: Sources) -> dict[str, object]:
    """``vllm bench serve``'s long flags and their defaults: the ``add_argument`` calls of
    ``add_cli_args`` and of the module functions it calls, as argparse would add them."""
    functions: dict[str, ast.FunctionDef] = {}
    constants: dict[str, object] = {}
    for module in SERVE_MODULES:
        tree = ast.parse(source(module))
        constants.update(_constants(tree))
        functions.update({n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)})
    flags: dict[str, object] = {}
    seen: set[str] = set()

    def visit(name: str) -> None:
        seen.add(name)
        for node in _calls_in_order(functions[name]):
            target = node.func
            if isinstance(target, ast.Attribute) and target.attr == "add_argument":
                default = _default(node, constants)
                negated = any(k.arg == "action" and _decorator_name(k.value) == "BooleanOptionalAction"
                              for k in node.keywords)
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and str(arg.value).startswith("--"):
                        flags[arg.value] = default
                        if negated:
                            flags["--no-" + arg.value[2:]] = default
            elif isinstance(target, ast.Name) and target.id in functions and target.id not in seen:
                visit(target.id)

    visit("add_cli_args")
    return flags


def _calls_in_order(fn: ast.AST) -> Iterable[ast.Call]:
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
    return sorted(calls, key=lambda n: (n.lineno, n.col_offset))


if __name__ == "__main__":
    # `make setup-dev`: fetch the wheel the tests read, once; silent when it is there.
    if cached(NEXT) is None:
        print(f"vLLM {NEXT}'s wheel for the tests: {fetch(NEXT)}")
