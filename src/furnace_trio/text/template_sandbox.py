"""The Jinja environment chat templates run in: Jinja's immutable sandbox, bounded.

A chat template is untrusted code, and so is every string a client puts into it. Jinja's
:class:`~jinja2.sandbox.ImmutableSandboxedEnvironment` keeps it away from Python internals
and from mutating its inputs, and bounds ``range()``; it bounds neither memory nor time.
This module adds both:

- *Size.* No string may grow past :data:`MAX_STRING_CHARS` and no list past
  :data:`MAX_ITEMS`. Operations whose result size is known from their arguments are
  checked *before* they allocate (``*``, ``+``, ``%`` and ``str.format`` widths,
  ``center``/``ljust``/``rjust``/``zfill``, ``replace``, ``join``, ``expandtabs``, and the
  filters that take a width or a count); every call, filter, ``~`` concatenation and the
  output as a whole are checked after. So ``'a'.center(67108864)`` fails without
  allocating, and a string doubled in a loop stops at the limit.
- *Writing.* What a rendering writes, to its output and to the buffers of ``{% set %}``
  blocks and macros together, is counted against :data:`MAX_EMITTED_CHARS`: a buffer
  filled in a loop is refused before it is joined.
- *Time.* Every loop iteration, call, filter and piece of output ticks a per-rendering budget of thread
  CPU time (:func:`render_budget`), so nested loops over ``range(100000)`` end with an
  error instead of holding a worker thread for hours.

The template's loops and ``~`` are reached by rewriting the parsed template before it is
compiled (:func:`bounded_template_ast`): each ``for`` iterates through the budget and each
concatenation passes through the size check. Failures raise :class:`TemplateLimitError`,
a :class:`~jinja2.sandbox.SecurityError`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import operator
import re
import string
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.runtime
import jinja2.sandbox
import jinja2.utils
import jinja2.visitor

__all__ = [
    "MAX_EMITTED_CHARS",
    "MAX_ITEMS",
    "MAX_REPEAT_RESULT",
    "MAX_STRING_CHARS",
    "RENDER_CPU_S",
    "BoundedSandbox",
    "TemplateLimitError",
    "bounded_template_ast",
    "check_output",
    "render_budget",
]

#: Upper bound for strings and lists a template builds with ``*`` (``'a' * 10**12``).
MAX_REPEAT_RESULT = 1 << 20
#: The longest string a template may build, the whole rendering included (16 Mi
#: characters: four times the prompt of a 128k-token context at 32 characters a token).
MAX_STRING_CHARS = 1 << 24
#: The most items of a list, tuple or dict a template may build.
MAX_ITEMS = 1 << 20
#: The most characters one rendering may write, into its output and into the buffers of
#: ``{% set %}`` blocks and macros together (what those buffers are later joined from).
MAX_EMITTED_CHARS = 4 * MAX_STRING_CHARS
#: Thread CPU time one rendering may take (real templates take about a millisecond).
RENDER_CPU_S = 2.0
# How many ticks pass between two reads of the thread's CPU clock.
_TICKS_PER_CHECK = 256


class TemplateLimitError(jinja2.sandbox.SecurityError):
    """A template went past a size or time limit (the message says which)."""


@dataclass(slots=True)
class _Budget:
    deadline: float  # on time.thread_time()'s clock
    cpu_s: float
    ticks: int = 0
    emitted: int = 0

    def tick(self) -> None:
        self.ticks += 1
        if self.ticks % _TICKS_PER_CHECK == 0 and time.thread_time() > self.deadline:
            raise TemplateLimitError(f"rendering took more than {self.cpu_s:g} s of CPU time")

    def emit(self, chars: int) -> None:
        self.emitted += chars
        if self.emitted > MAX_EMITTED_CHARS:
            raise TemplateLimitError(f"wrote more than {MAX_EMITTED_CHARS} characters")


# The rendering in progress in this thread (context), if any: set by render_budget().
_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar(
    "furnace_template_budget", default=None
)


@contextlib.contextmanager
def render_budget(cpu_s: float = RENDER_CPU_S) -> Iterator[None]:
    """Bound the CPU time of the renderings done inside (in this thread)."""
    token = _BUDGET.set(_Budget(time.thread_time() + cpu_s, cpu_s))
    try:
        yield
    finally:
        _BUDGET.reset(token)


def _tick() -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.tick()


def _check_size(value: Any) -> Any:
    """``value``, unless it is a string or collection past the limits."""
    if isinstance(value, str | bytes):
        if len(value) > MAX_STRING_CHARS:
            raise TemplateLimitError(f"string too long (over {MAX_STRING_CHARS} characters)")
    elif isinstance(value, list | tuple | dict | set | frozenset) and len(value) > MAX_ITEMS:
        raise TemplateLimitError(f"collection too large (over {MAX_ITEMS} items)")
    return value


def check_output(chunks: Iterable[str]) -> str:
    """The rendering's output chunks joined, refused past :data:`MAX_STRING_CHARS`."""
    out: list[str] = []
    total = 0
    for chunk in chunks:
        total += len(chunk)
        if total > MAX_STRING_CHARS:
            raise TemplateLimitError(f"output too long (over {MAX_STRING_CHARS} characters)")
        out.append(chunk)
        _tick()
    return "".join(out)


def _check_length(length: int) -> None:
    if length > MAX_STRING_CHARS:
        raise TemplateLimitError(f"result too long (over {MAX_STRING_CHARS} characters)")


def _check_count(count: object, what: str) -> None:
    if isinstance(count, int) and count > MAX_ITEMS:
        raise TemplateLimitError(f"{what} {count} is too large (at most {MAX_ITEMS})")


# printf conversions: flags, width and precision (digits or '*').
_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d*))?")
# str.format specs: [[fill]align][sign][z][#][0][width][grouping][.precision]
_FORMAT_SPEC = re.compile(r"(?:.?[<>=^])?[-+ ]?z?#?0?(\d*)[,_]?(?:\.(\d+))?")


def _check_numbers(numbers: Iterable[object], what: str) -> None:
    for number in numbers:
        if isinstance(number, int) and number > MAX_REPEAT_RESULT:
            raise TemplateLimitError(f"{what} {number} is too large (at most {MAX_REPEAT_RESULT})")


def _check_printf(fmt: object, args: object) -> None:
    """``fmt % args`` must not ask for a huge width or precision."""
    if not isinstance(fmt, str):
        return
    for match in _PRINTF.finditer(fmt):
        _check_numbers((int(g) for g in match.groups() if g and g.isdigit()), "format width")
        if "*" in match.groups():
            _check_numbers(args if isinstance(args, tuple) else (args,), "format width")


def _check_str_format(fmt: str, args: Iterable[object]) -> None:
    """``fmt.format(...)`` must not ask for a huge width or precision (nested fields:
    no huge integer among the arguments)."""
    for _, field, spec, _ in string.Formatter().parse(fmt):
        if field is None or not spec:
            continue
        if "{" in spec:
            _check_numbers(args, "format width")
        match = _FORMAT_SPEC.match(spec)
        if match is not None:
            _check_numbers((int(g) for g in match.groups() if g), "format width")


def _str_method_result(method: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a ``str`` method call whose result would be too long, before it allocates."""
    name = getattr(method, "__name__", "")
    owner = getattr(method, "__self__", None)
    wrapped = getattr(method, "__wrapped__", None)  # Jinja's sandboxed str.format
    if wrapped is not None and isinstance(getattr(wrapped, "__self__", None), str):
        values = [*args, *kwargs.values()]
        values += [v for a in args if isinstance(a, Mapping) for v in a.values()]  # format_map
        _check_str_format(wrapped.__self__, values)
        return
    if not isinstance(owner, str):
        return
    if name in ("center", "ljust", "rjust", "zfill"):
        width = args[0] if args else kwargs.get("width", 0)
        if isinstance(width, int):
            _check_length(width)
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(size, int):
            _check_length(len(owner) + owner.count("\t") * max(size, 0))
    elif name == "replace" and len(args) >= 2:
        _check_replace(owner, args[0], args[1])
    elif name == "join" and args:
        _check_join(owner, args[0])


def _check_replace(s: object, old: object, new: object) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        count = len(s) + 1 if not old else s.count(old)
        _check_length(len(s) + count * (len(new) - len(old)))


def _check_join(sep: str, items: object) -> None:
    if isinstance(items, list | tuple):
        _check_length(
            sum(len(i) if isinstance(i, str) else 0 for i in items) + len(sep) * len(items)
        )


_MAX_JSON_INDENT = 64
_MAX_LIPSUM = 100

_JINJA_CONTEXTS = (jinja2.runtime.Context, jinja2.nodes.EvalContext, jinja2.Environment)


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` with the budget ticked, its result size checked, and for the filters that
    take a width, a count or a format, their arguments checked first."""

    @functools.wraps(func)  # keeps Jinja's pass_context / async markers
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _tick()
        values = [a for a in args if not isinstance(a, _JINJA_CONTEXTS)]
        if name in ("center", "batch", "slice"):
            _check_numbers([*values[1:], *kwargs.values()], f"{name} argument")
        elif name == "indent" and values and isinstance(values[0], str):
            width = values[1] if len(values) > 1 else kwargs.get("width", 4)
            per_line = len(width) if isinstance(width, str) else width
            if isinstance(per_line, int):
                _check_length(len(values[0]) + (values[0].count("\n") + 1) * per_line)
        elif name == "tojson":
            indent = values[2] if len(values) > 2 else kwargs.get("indent")
            size = len(indent) if isinstance(indent, str) else indent
            if isinstance(size, int) and size > _MAX_JSON_INDENT:
                raise TemplateLimitError(f"tojson indent {size} is over {_MAX_JSON_INDENT}")
        elif name == "wordwrap" and values and isinstance(values[0], str):
            width = values[1] if len(values) > 1 else kwargs.get("width", 79)
            wrap = values[3] if len(values) > 3 else kwargs.get("wrapstring", "\n")
            if isinstance(width, int) and isinstance(wrap, str) and width > 0:
                _check_length(len(values[0]) + (len(values[0]) // width + 1) * len(wrap))
        elif name == "format" and values:
            _check_printf(values[0], tuple(values[1:]) or tuple(kwargs.values()))
        elif name == "replace" and len(values) >= 3:
            _check_replace(values[0], values[1], values[2])
        elif name == "join" and values:
            items = values[0]
            sep = values[1] if len(values) > 1 else kwargs.get("d", "")
            if isinstance(sep, str) and isinstance(items, list | tuple):
                _check_join(sep, items)
        return _check_size(func(*args, **kwargs))

    return bounded


def _bounded_lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    """Jinja's ``lipsum`` global, for at most :data:`_MAX_LIPSUM` paragraphs and words."""
    if n > _MAX_LIPSUM or max > _MAX_LIPSUM:
        raise TemplateLimitError(f"lipsum of more than {_MAX_LIPSUM} paragraphs or words")
    return str(jinja2.utils.generate_lorem_ipsum(n=n, html=html, min=min, max=max))


class _BudgetExtension(jinja2.ext.Extension):
    """What the rewritten template calls: its loops' iterables and concatenations go
    through here (see :func:`bounded_template_ast`)."""

    def loop(self, iterable: Iterable[Any]) -> Iterator[Any]:
        for item in iterable:
            _tick()
            yield item

    def sized(self, value: Any) -> Any:
        return _check_size(value)

    def emitted(self, value: Any) -> Any:
        budget = _BUDGET.get()
        if budget is not None:
            budget.tick()
            budget.emit(len(value) if isinstance(value, str) else len(str(value)))
        return value


class _Bounder(jinja2.visitor.NodeTransformer):
    """Rewrites ``for x in it`` to ``for x in <budget>.loop(it)``, ``a ~ b`` to
    ``<budget>.sized(a ~ b)`` and each piece of output ``x`` to ``<budget>.emitted(x)``;
    the extension attribute cannot be shadowed by a template."""

    def __init__(self) -> None:
        self.identifier = _BudgetExtension.identifier

    def _call(self, name: str, arg: jinja2.nodes.Node) -> jinja2.nodes.Call:
        func = jinja2.nodes.ExtensionAttribute(self.identifier, name, lineno=arg.lineno)
        return jinja2.nodes.Call(func, [arg], [], None, None, lineno=arg.lineno)

    def visit_For(self, node: jinja2.nodes.For) -> jinja2.nodes.Node:
        self.generic_visit(node)
        node.iter = self._call("loop", node.iter)
        return node

    def visit_Concat(self, node: jinja2.nodes.Concat) -> jinja2.nodes.Node:
        self.generic_visit(node)
        return self._call("sized", node)

    def visit_Output(self, node: jinja2.nodes.Output) -> jinja2.nodes.Node:
        self.generic_visit(node)
        node.nodes = [self._call("emitted", child) for child in node.nodes]
        return node


def bounded_template_ast(env: jinja2.Environment, source: str) -> jinja2.nodes.Template:
    """``source`` parsed, with every loop and concatenation rewritten to be bounded."""
    template = env.parse(source)
    _Bounder().visit(template)
    return template


class BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The immutable sandbox with the size and time bounds of this module. Compile
    templates with ``from_string(bounded_template_ast(env, source))``."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **options: Any) -> None:
        extensions = [*options.pop("extensions", ()), _BudgetExtension]
        super().__init__(extensions=extensions, **options)
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.globals["lipsum"] = _bounded_lipsum

    def add_filter(self, name: str, func: Callable[..., Any]) -> None:
        """Install a filter with the bounds every filter here has."""
        self.filters[name] = _bounded_filter(name, func)

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        # Jinja returns an Undefined that only raises when used further, so
        # ``{{ f.__globals__ }}`` would print "" and pass silently: refuse outright.
        raise jinja2.sandbox.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )

    def call(
        __self,  # Jinja's signature: keeps a keyword argument named self free
        __context: jinja2.runtime.Context,
        __obj: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if type(getattr(__obj, "__self__", None)) is _BudgetExtension:
            return __obj(*args)  # the rewriting's own calls: they check themselves
        _tick()
        _str_method_result(__obj, args, kwargs)
        return _check_size(super().call(__context, __obj, *args, **kwargs))

    def call_binop(
        self, context: jinja2.runtime.Context, operator_: str, left: Any, right: Any
    ) -> Any:
        if operator_ == "*":
            for seq, count in ((left, right), (right, left)):
                if (
                    isinstance(seq, str | bytes | list | tuple)
                    and isinstance(count, int)
                    and len(seq) * count > MAX_REPEAT_RESULT
                ):
                    raise TemplateLimitError(
                        f"repetition result too large (over {MAX_REPEAT_RESULT} items)"
                    )
            return operator.mul(left, right)
        if operator_ == "**":
            if (
                isinstance(right, int)
                and abs(right) > 64
                and isinstance(left, int)
                and abs(left) > 1
            ):
                raise TemplateLimitError("exponent too large")
            return operator.pow(left, right)
        if operator_ == "+":
            if isinstance(left, str) and isinstance(right, str):
                _check_length(len(left) + len(right))
            elif isinstance(left, list | tuple) and isinstance(right, list | tuple):
                _check_count(len(left) + len(right), "collection size")
            return operator.add(left, right)
        if operator_ == "%" and isinstance(left, str):
            _check_printf(left, right)
            return _check_size(operator.mod(left, right))
        return super().call_binop(context, operator_, left, right)
