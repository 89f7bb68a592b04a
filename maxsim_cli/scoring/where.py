"""Metadata filters (``where``): a condition on the metadata columns of Arrow and Parquet shards, the
columns beside ``id``, ``embedding``, ``scales`` and ``length`` (docs/format.md), as a
`pyarrow.compute.Expression`; pyarrow evaluates it.

From Python, ``search(..., where=pc.field("lang") == "en")`` takes the expression itself. The command line
(`maxsim score --where`) and `maxsim serve` (``"where"``) take it as text (`parse_where`): a Python
expression of pyarrow's own expression syntax, ``lang == "en" and year >= 2020``, read by Python's parser
(`ast.parse`, which builds a tree and runs nothing) and turned into the `Expression` node by node through
what is listed here alone (a column name, `pyarrow.compute.field` / `scalar`, literals, comparisons, ``in``,
``and`` / ``or`` / ``not``, arithmetic and the functions of `FUNCTIONS`). The text is never evaluated: a
served request's body is untrusted, and Python's ``eval``, even with no builtins, reaches any object
(``().__class__.__base__...``). pyarrow has no text form of an expression to read instead: its own
serialised forms are binary (``Expression._deserialize``, what pickling uses, an Arrow IPC buffer;
Substrait's ``Expression.from_substrait``, a protobuf message).

Evaluation (`matching`): a shard at a time, a record batch (row group) at a time, only the columns the
expression names are read (validated by Arrow before a value is read), never the token vectors; each
piece is filtered by pyarrow (``Table.filter``: a document whose condition is null is left out, as SQL's
WHERE leaves it out) and what is kept is one bool a document. A corpus's masks of the last
`CACHED_FILTERS` expressions are kept, packed (a bit a document): a server answering the same ``where``
again reads no column.
"""

from __future__ import annotations

import ast
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from maxsim_cli.errors import EXCLUDE, INCLUDE, WHERE, InputError, UsageError
from maxsim_cli.shards.format import one_line

# The pyarrow.compute functions a text filter may call (``starts_with(title, "The")``), each with the
# expression's own arguments: element-wise functions whose cost is the column's.
FUNCTIONS = frozenset(
    {
        "starts_with",
        "ends_with",
        "match_substring",
        "match_substring_regex",
        "match_like",
        "utf8_lower",
        "utf8_upper",
        "utf8_length",
        "is_null",
        "is_valid",
        "is_nan",
        "year",
        "month",
        "day",
        "abs",
        "list_value_length",
    }
)
# The methods of an expression a text filter may call: ``tag.isin(["a", "b"])``, ``date.cast("date32")``.
METHODS = frozenset({"isin", "is_null", "is_valid", "is_nan", "cast"})
# How long a text filter may be, and how deep its expression: bounds on what a request makes us build.
MAX_WHERE_CHARS = 4096
MAX_WHERE_DEPTH = 64
# Masks of this many expressions are kept per corpus (`matching`).
CACHED_FILTERS = 8

_COMPARE = {
    ast.Eq: lambda a, b: a == b,
    ast.NotEq: lambda a, b: a != b,
    ast.Lt: lambda a, b: a < b,
    ast.LtE: lambda a, b: a <= b,
    ast.Gt: lambda a, b: a > b,
    ast.GtE: lambda a, b: a >= b,
}
_ARITHMETIC = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.BitAnd: lambda a, b: a & b,
    ast.BitOr: lambda a, b: a | b,
}
_MODULES = ("pc", "pyarrow.compute", "compute")
_LITERAL_TYPES = (str, int, float, bool, type(None))
_TOO_DEEP = "{}: nested too deeply; a filter may nest {} deep"


class WhereSyntaxError(UsageError):
    """A text filter that is not one (`parse_where`)."""


def parse_where(text: str) -> pc.Expression:
    """The `pyarrow.compute.Expression` that ``text`` spells (module docstring): a column by its name
    (``lang``) or ``field("a name")``, literals (strings, numbers, True, False, None, lists), ``==``,
    ``!=``, ``<``, ``<=``, ``>``, ``>=`` (chained too), ``in`` / ``not in`` a list, ``and``, ``or``,
    ``not`` (and ``&``, ``|``, ``~``), ``+ - * /``, ``scalar(value)``, the functions of `FUNCTIONS`
    and the methods of `METHODS`; a ``pc.`` prefix is allowed, so that a Python filter can be pasted.
    Anything else is a `WhereSyntaxError` naming it."""
    if not isinstance(text, str):
        raise UsageError(f"{WHERE}: got {type(text).__name__}; give a pyarrow.compute.Expression or its text")
    if not text.strip():
        raise WhereSyntaxError(f'{WHERE}: empty; give a condition such as lang == "en"')
    if len(text) > MAX_WHERE_CHARS:
        raise WhereSyntaxError(f"{WHERE}: {len(text)} characters; a filter may have {MAX_WHERE_CHARS}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
        value = _Builder(text).build(tree.body, 0)
    except SyntaxError as exc:
        raise WhereSyntaxError(
            f"{WHERE} {_shown(text)}: not an expression ({exc.msg}); write a "
            'condition such as lang == "en" and year >= 2020'
        ) from None
    except (RecursionError, MemoryError):
        raise WhereSyntaxError(_TOO_DEEP.format(WHERE, MAX_WHERE_DEPTH)) from None
    if isinstance(value, bool):
        return pc.scalar(value)
    if not isinstance(value, pc.Expression):
        raise WhereSyntaxError(
            f"{WHERE} {_shown(text)}: a {type(value).__name__}, not a condition on the metadata columns"
        )
    return value


class _Builder:
    """Turns the tree of a text filter into an expression, node by node (`parse_where`)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def refuse(self, node: ast.AST, what: str) -> WhereSyntaxError:
        where = f" (column {node.col_offset + 1})" if hasattr(node, "col_offset") else ""
        return WhereSyntaxError(f"{WHERE} {_shown(self.text)}: {what}{where} is not allowed in a filter")

    def build(self, node: ast.AST, depth: int) -> Any:
        if depth > MAX_WHERE_DEPTH:
            raise WhereSyntaxError(_TOO_DEEP.format(WHERE, MAX_WHERE_DEPTH))
        depth += 1
        try:
            return self._build(node, depth)
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
            raise WhereSyntaxError(f"{WHERE} {_shown(self.text)}: {one_line(exc)}") from None

    def _build(self, node: ast.AST, depth: int) -> Any:
        if isinstance(node, ast.Constant):
            if not isinstance(node.value, _LITERAL_TYPES):
                raise self.refuse(node, f"the literal {node.value!r}")
            return node.value
        if isinstance(node, ast.Name):
            return pc.field(node.id)
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            values = [self.build(item, depth) for item in node.elts]
            if any(isinstance(v, (pc.Expression, list)) for v in values):
                raise self.refuse(node, "a list of other than literals")
            return values
        if isinstance(node, ast.UnaryOp):
            operand = self.build(node.operand, depth)
            if isinstance(node.op, (ast.Not, ast.Invert)):
                return ~_expression(operand)
            if isinstance(node.op, (ast.USub, ast.UAdd)) and isinstance(operand, (int, float)):
                return -operand if isinstance(node.op, ast.USub) else operand
            if isinstance(node.op, ast.USub) and isinstance(operand, pc.Expression):
                return pc.negate_checked(operand)
            raise self.refuse(node, type(node.op).__name__)
        if isinstance(node, ast.BoolOp):
            values = [_expression(self.build(v, depth)) for v in node.values]
            out = values[0]
            for value in values[1:]:
                out = out & value if isinstance(node.op, ast.And) else out | value
            return out
        if isinstance(node, ast.BinOp):
            operation = _ARITHMETIC.get(type(node.op))
            if operation is None:
                raise self.refuse(node, f"the operator {type(node.op).__name__}")
            left, right = self.build(node.left, depth), self.build(node.right, depth)
            return operation(_expression(left), _expression(right))
        if isinstance(node, ast.Compare):
            return self._compare(node, depth)
        if isinstance(node, ast.Call):
            return self._call(node, depth)
        raise self.refuse(node, type(node).__name__)

    def _compare(self, node: ast.Compare, depth: int) -> pc.Expression:
        left = self.build(node.left, depth)
        out = None
        for op, right_node in zip(node.ops, node.comparators, strict=True):
            right = self.build(right_node, depth)
            if isinstance(op, (ast.In, ast.NotIn)):
                if not isinstance(left, pc.Expression) or not isinstance(right, list):
                    raise self.refuse(node, "'in' other than a column in a list of values")
                part = left.isin(right)
                part = ~part if isinstance(op, ast.NotIn) else part
            else:
                compare = _COMPARE.get(type(op))
                if compare is None:
                    raise self.refuse(node, f"the comparison {type(op).__name__}")
                if isinstance(left, list) or isinstance(right, list):
                    raise self.refuse(node, "a list compared with '==' or '<' ('in' takes a list)")
                part = compare(_expression(left), _expression(right))
            out = part if out is None else out & part
            left = right
        assert out is not None
        return out

    def _call(self, node: ast.Call, depth: int) -> Any:
        func = node.func
        name = _dotted(func)
        if name is not None:
            for module in _MODULES:
                name = name.removeprefix(module + ".")
            if "." in name:
                raise self.refuse(node, f"the function {name}")
            args = [self.build(a, depth) for a in node.args]
            kwargs = {k.arg: self.build(k.value, depth) for k in node.keywords if k.arg is not None}
            if len(kwargs) != len(node.keywords) or any(isinstance(a, ast.Starred) for a in node.args):
                raise self.refuse(node, "*args or **kwargs")
            if any(isinstance(v, (pc.Expression, list)) for v in kwargs.values()):
                raise self.refuse(node, f"a keyword of {name} that is not a literal")
            if name == "field":
                if not args or kwargs or not all(isinstance(a, str) for a in args):
                    raise self.refuse(node, "field() of other than column names")
                return pc.field(*args)
            if name == "scalar":
                if len(args) != 1 or kwargs or not isinstance(args[0], _LITERAL_TYPES):
                    raise self.refuse(node, "scalar() of other than one literal")
                return pc.scalar(args[0])
            if name not in FUNCTIONS:
                raise self.refuse(node, f"the function {name}")
            if not args or any(isinstance(a, list) for a in args):
                raise self.refuse(node, f"{name}() without a column, or with a list")
            return getattr(pc, name)(_expression(args[0]), *args[1:], **kwargs)
        if isinstance(func, ast.Attribute):  # a method of an expression: field("tag").isin([...])
            if func.attr not in METHODS:
                raise self.refuse(node, f"the method {func.attr}")
            target = _expression(self.build(func.value, depth))
            args = [self.build(a, depth) for a in node.args]
            if node.keywords or any(isinstance(a, pc.Expression) for a in args):
                raise self.refuse(node, f"{func.attr}() of other than literals")
            if func.attr == "cast":
                if len(args) != 1 or not isinstance(args[0], str):
                    raise self.refuse(node, 'cast() of other than a type\'s name ("date32", "string")')
                return target.cast(pa.type_for_alias(args[0]))
            return getattr(target, func.attr)(*args)
        raise self.refuse(node, "this call")


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a call of a name or of a module's name; None for a method of a value."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        if base is not None and (base in _MODULES or base.split(".")[0] in ("pyarrow",)):
            return f"{base}.{node.attr}"
    return None


def _expression(value: Any) -> pc.Expression:
    if isinstance(value, pc.Expression):
        return value
    if isinstance(value, list):
        raise TypeError("a list where a value or a column goes ('in' takes a list)")
    return pc.scalar(value)


def _shown(text: str) -> str:
    """A filter's text as messages show it: one line, at most 120 characters."""
    return repr(one_line(text, 120))


def as_expression(where: Any) -> tuple[pc.Expression, str]:
    """``where`` (an `Expression`, or its text: `parse_where`) as an expression, and how messages show
    it."""
    if isinstance(where, pc.Expression):
        return where, _shown(str(where))
    if isinstance(where, str):
        return parse_where(where), _shown(where)
    raise UsageError(
        f'{WHERE}: got {type(where).__name__}; give a pyarrow.compute.Expression (pc.field("lang") == '
        '"en") or its text'
    )


# --------------------------------------------------------------------------------------------------
# evaluation


def matching(corpus: Any, where: Any) -> np.ndarray:
    """A bool array over the corpus's documents: True where ``where`` (`as_expression`) holds. Each
    shard's metadata columns that the expression names are read, a record batch / row group at a time;
    an `InputError` names the shard for a column it lacks, a shard without metadata columns, or a
    comparison of a column with a value of another type."""
    expr, shown = as_expression(where)
    key = _key(expr)
    kept = _cached(corpus, key)
    if kept is not None:
        return kept
    out = np.zeros(len(corpus), dtype=bool)
    columns_of: list[tuple[pa.Schema, list[str]]] = []  # one bind per distinct schema
    for start, shard in zip(corpus.doc_starts[:-1].tolist(), corpus.shards, strict=True):
        out[start : start + shard.num_docs] = _shard_matches(shard, expr, shown, columns_of)
    _keep(corpus, key, out)
    return out


def _shard_matches(
    shard: Any, expr: pc.Expression, shown: str, columns_of: list[tuple[pa.Schema, list[str]]]
) -> np.ndarray:
    schema = shard.metadata_schema()
    if schema is None or len(schema) == 0:
        what = (
            f"a {shard.info.format} shard has none"
            if schema is None
            else "this shard has no column beside id and embedding"
        )
        raise InputError(
            f"{shard.path}: {WHERE} {shown} reads metadata columns, and {what}; write the corpus as Arrow "
            f"or Parquet shards with the metadata as columns of their own (docs/format.md), or filter by "
            f"ids ({INCLUDE} / {EXCLUDE})"
        )
    columns = next((cols for known, cols in columns_of if known.equals(schema)), None)
    if columns is None:
        columns = _columns(expr, shown, schema, shard.path)
        columns_of.append((schema, columns))
    matched = np.zeros(shard.num_docs, dtype=bool)
    row = _row_name(schema)
    for first, table in shard.metadata_tables(columns):
        positions = pa.array(np.arange(table.num_rows, dtype=np.int64))
        piece = table.append_column(row, positions) if columns else pa.table({row: positions})
        try:
            kept = piece.filter(expr).column(row)
        except (pa.ArrowException, ValueError, TypeError) as exc:  # met in the values: a cast, an overflow
            raise InputError(f"{shard.path}: {WHERE} {shown}: {one_line(exc)}") from None
        matched[first + kept.to_numpy()] = True
    return matched


def _row_name(schema: pa.Schema) -> str:
    """A column name that the shard's metadata does not hold, for the documents' positions."""
    name = "__maxsim_row"
    while name in schema.names:
        name += "_"
    return name


def _empty(schema: pa.Schema) -> pa.Table:
    return schema.empty_table()


_UNKNOWN = re.compile(r"No match for FieldRef\.Name\((.*?)\) in ")
_TWICE = re.compile(r"Multiple matches for FieldRef\.Name\((.*?)\) in ")


def _columns(expr: pc.Expression, shown: str, schema: pa.Schema, path: str) -> list[str]:
    """The metadata columns ``expr`` names, once it is known to apply to ``schema`` (bound by pyarrow on
    an empty table): a column whose absence stops the binding is one it names. `InputError`s for an
    unknown column, a column twice in the shard, types that no function takes, or a result that is not
    a bool."""
    used = []
    for i, name in enumerate(schema.names):
        try:
            _empty(schema.remove(i)).filter(expr)
        except pa.ArrowInvalid as exc:
            if _UNKNOWN.search(str(exc)):
                used.append(name)
        except (pa.ArrowException, ValueError, TypeError):
            pass  # a binding error of its own, named below
    try:
        _empty(schema).filter(expr)
    except pa.ArrowInvalid as exc:
        message = str(exc)
        unknown, twice = _UNKNOWN.search(message), _TWICE.search(message)
        if unknown:
            raise InputError(_unknown_column(path, shown, unknown.group(1), schema)) from None
        if twice:
            raise InputError(
                f"{path}: column {twice.group(1)!r} appears more than once; a filter needs each column "
                "once: write the shard again with one of them"
            ) from None
        raise InputError(f"{path}: {WHERE} {shown}: {one_line(exc)}") from None
    except pa.ArrowNotImplementedError as exc:  # no kernel for these types: a column vs a literal
        typed = ", ".join(f"{n} is {schema.field(n).type}" for n in used) or "no column"
        raise InputError(
            f"{path}: {WHERE} {shown}: {_first_line(exc)} ({typed} here); compare each column with values "
            'of its type (text in quotes, numbers without), or cast it: year.cast("string")'
        ) from None
    except pa.ArrowTypeError as exc:  # "Filter expression must evaluate to bool, but ..."
        raise InputError(
            f"{path}: {WHERE} {shown} is not a condition ({_first_line(exc)}); compare it with a value, as "
            "in year >= 2020"
        ) from None
    except (pa.ArrowException, ValueError, TypeError) as exc:
        raise InputError(f"{path}: {WHERE} {shown}: {one_line(exc)}") from None
    return used


def _first_line(exc: BaseException) -> str:
    return one_line(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


def _unknown_column(path: str, shown: str, name: str, schema: pa.Schema) -> str:
    have = ", ".join(f"{field.name} ({field.type})" for field in schema) or "none"
    if name == "id":
        return (
            f"{path}: {WHERE} {shown}: 'id' is not a metadata column; filter by ids with {INCLUDE} / "
            f"{EXCLUDE}"
        )
    if name in ("embedding", "scales", "length"):
        return f"{path}: {WHERE} {shown}: {name!r} holds the token vectors, not metadata (metadata: {have})"
    return (
        f"{path}: {WHERE} {shown}: no metadata column {name!r} in this shard (it has: {have}); name one of "
        "them, or give every shard the column"
    )


# --------------------------------------------------------------------------------------------------
# the masks of recent expressions, per corpus


_CACHE: weakref.WeakKeyDictionary[Any, tuple[tuple[int, ...], OrderedDict[bytes, np.ndarray]]] = (
    weakref.WeakKeyDictionary()
)
_CACHE_LOCK = threading.Lock()


def _key(expr: pc.Expression) -> bytes | None:
    """The expression's own serialised form (what pickling it writes): equal for equal expressions,
    literal types included; None where pyarrow cannot serialise it."""
    try:
        return bytes(expr.__reduce__()[1][0])
    except Exception:  # noqa: BLE001 - no key: the mask is made every time
        return None


def _shards_of(corpus: Any) -> tuple[int, ...]:
    return tuple(id(shard) for shard in corpus.shards)


def _cached(corpus: Any, key: bytes | None) -> np.ndarray | None:
    if key is None:
        return None
    with _CACHE_LOCK:
        try:
            entry = _CACHE.get(corpus)
        except TypeError:
            return None
        if entry is None or entry[0] != _shards_of(corpus) or key not in entry[1]:
            return None
        entry[1].move_to_end(key)
        packed = entry[1][key]
    return np.unpackbits(packed, count=len(corpus)).astype(bool)


def _keep(corpus: Any, key: bytes | None, mask: np.ndarray) -> None:
    if key is None:
        return
    with _CACHE_LOCK:
        try:
            entry = _CACHE.get(corpus)
            if entry is None or entry[0] != _shards_of(corpus):
                entry = (_shards_of(corpus), OrderedDict())
                _CACHE[corpus] = entry
        except TypeError:  # a corpus that cannot be weakly referenced: nothing kept
            return
        entry[1][key] = np.packbits(mask)
        while len(entry[1]) > CACHED_FILTERS:
            entry[1].popitem(last=False)


__all__: Sequence[str] = ["FUNCTIONS", "METHODS", "WHERE", "as_expression", "matching", "parse_where"]
