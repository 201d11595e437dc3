"""The public surface: what the top level exports, and one home per public name."""

import ast
import importlib
import inspect
import pathlib
import re

import jaxcache

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULES = sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "jaxcache").rglob("*.py"))

TOP_LEVEL = {
    "CacheConfig",
    "CacheState",
    "CacheStats",
    "CapacityError",
    "Checkpointer",
    "DynamicVocabulary",
    "EmbeddingCache",
    "FrequencyCounter",
    "HostTable",
    "Lookup",
    "NonFiniteError",
    "Server",
    "SparseOptimizer",
    "TieredTable",
    "adagrad",
    "adam",
    "linen",
    "nnx",
    "prefetch",
    "replay",
    "rowwise_adagrad",
    "serving_config",
    "sgd",
}

SUBMODULES = (
    "nnx",
    "linen",
    "device",
    "host",
    "optimizers",
    "pipeline",
    "checkpoint",
    "stats",
    "planning",
    "sizing",
    "testing",
    "synthetic",
    "models",
    "datasets",
)


def test_the_top_level_exports_the_listed_names():
    assert set(jaxcache.__all__) == TOP_LEVEL
    assert len(jaxcache.__all__) <= 25
    for name in jaxcache.__all__:
        assert getattr(jaxcache, name) is not None


def test_every_public_attribute_is_exported_or_a_public_submodule():
    public = {name for name in vars(jaxcache) if not name.startswith("_")}
    submodules = {name for name in public if inspect.ismodule(getattr(jaxcache, name))}
    assert public - submodules == TOP_LEVEL - {"nnx", "linen"}
    assert submodules <= set(SUBMODULES)


def test_each_public_name_has_one_home():
    homes: dict[int, str] = {}
    for module_name in ("jaxcache", *(f"jaxcache.{name}" for name in SUBMODULES)):
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj) or not (inspect.isclass(obj) or callable(obj)):
                continue
            assert id(obj) not in homes, f"{module_name}.{name} is also {homes[id(obj)]}"
            homes[id(obj)] = f"{module_name}.{name}"


def test_public_modules_document_nothing_through_private_imports():
    for module_name in ("jaxcache", *(f"jaxcache.{name}" for name in SUBMODULES)):
        module = importlib.import_module(module_name)
        for name in module.__all__:
            doc = inspect.getdoc(getattr(module, name)) or ""
            assert "from jaxcache._src" not in doc, f"{module_name}.{name} teaches a private import"


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    following = re.search(r"^## ", text[start + len(heading) :], flags=re.MULTILINE)
    return text[start : start + len(heading) + following.start()] if following else text[start:]


def _readme_layout() -> set[str]:
    """Modules named in the README's layout table: a cell's first path sets
    the folder of the bare file names after it."""
    named = set()
    for line in _section((ROOT / "README.md").read_text(), "## Layout").splitlines():
        if not line.startswith("| `"):
            continue
        folder = ""
        for token in re.findall(r"`([^`]+)`", line.split("|")[1]):
            if "/" in token:
                folder, token = token.rsplit("/", 1)
            named.add(f"{folder}/{token}")
    return named


def _design_tables() -> set[str]:
    """Modules named in docs/design.md's tables headed ``File (`folder/`)``."""
    named, folder = set(), None
    for line in (ROOT / "docs" / "design.md").read_text().splitlines():
        header = re.match(r"\| File \(`([^`]+)/`\)", line)
        if header:
            folder = header.group(1)
        elif folder and line.startswith("| `"):
            named.update(
                f"{folder}/{name}" for name in re.findall(r"`([^`]+\.py)`", line.split("|")[1])
            )
        elif not line.startswith("|"):
            folder = None
    return named


def test_the_readme_and_the_design_notes_list_every_module():
    assert set(MODULES) - _readme_layout() == set(), "add these to the README's layout table"
    assert set(MODULES) - _design_tables() == set(), "add these to docs/design.md's tables"


def test_every_module_says_what_it_owns_in_its_first_line():
    for module in MODULES:
        doc = ast.get_docstring(ast.parse((ROOT / module).read_text())) or ""
        assert doc.split("\n", 1)[0].strip(), f"{module} needs a docstring saying what it owns"


def _private_imports() -> dict[str, set[str]]:
    """The modules of jaxcache/_src each one imports, those imported for
    type checking or inside a function included."""
    src = pathlib.Path(jaxcache.__file__).parent / "_src"
    modules = {path.stem for path in src.glob("*.py")}
    imports: dict[str, set[str]] = {}
    for path in src.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxcache._src"):
                parts = node.module.split(".")  # type: ignore[union-attr]
                found |= {parts[2]} if len(parts) > 2 else {alias.name for alias in node.names}
        imports[path.stem] = found & modules
    return imports


def test_the_private_modules_import_in_layers_without_a_cycle():
    imports = _private_imports()
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, " -> ".join((*path, module))
        if module not in done:
            for imported in sorted(imports[module]):
                visit(imported, (*path, module))
            done.add(module)

    for module in sorted(imports):
        visit(module, ())


def test_the_device_code_imports_no_host_code():
    # The functions that run in jit (plan, swap, lookup, sparse update) are
    # pure jnp over explicit state; none of them reaches the host's tables,
    # planners or threads.
    device = {"device_ops", "device_plan", "device_vocabulary", "optimizers", "sparse_grad"}
    shared = {"hashing"}  # hashes of raw ids, alike in NumPy and jnp
    imports = _private_imports()
    for module in sorted(device):
        assert imports[module] <= device | shared, (module, imports[module] - device - shared)
