"""Bodies are parsed by their typed models, and a programming error is never answered as the client's.

- The request's JSON is read in one place (tinker/routes.json_body) and parsed by its model
  (tinker/bodies.py; the native and OpenAI routes take theirs as FastAPI body parameters): no route
  module subscripts a raw `body`, calls `.get`/`.setdefault`/... on it, or takes it as a `dict`.
- No `except` in twinkle.serve catches TypeError, AttributeError or KeyError (a bug in our code, or in
  a library we call) unless it is listed below with the reason: a caught one would become a 400 that
  blames the client and logs nothing. The input is validated before the call instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

SERVE = Path(__file__).resolve().parents[1] / "src" / "twinkle" / "serve"
ROUTE_PACKAGES = ("tinker", "native", "openai")
PARSING = {"tinker/bodies.py", "tinker/routes.py:json_body"}  # where the raw JSON object is read and parsed
RAW = {"body"}  # the names a route gives the request body
DICT_READS = {"get", "setdefault", "pop", "items", "keys", "values", "update"}
BUGS = {"TypeError", "AttributeError", "KeyError"}
EVERYTHING = {"Exception", "BaseException"}  # a catch-all holds BUGS too
USER_ERRORS = {"BadRequest", "UserError", "OpenAIError", "ApiError", "NotFound"}  # what the client is told is theirs

# (file, function) -> why catching one of BUGS there answers the client's mistake, not ours
ALLOWED = {
    ("core/lora_configs.py", "lora_config"): "peft's LoraConfig signals an argument it refuses by TypeError/ValueError",
    ("backend/multi_lora_backend.py", "configure_adapter"): (
        "the client names the class (a loss, an optimizer, a scheduler) and its kwargs: the class's constructor "
        "refuses them by TypeError/ValueError"
    ),
    ("backend/micro_batches.py", "forward_backward_in_runs"): (
        "answers nothing: rows the loss cannot count run as one pass, which fails in its own words"
    ),
    ("backend/multi_lora_backend.py", "load_checkpoint"): (
        "a checkpoint folder the tenant named (imported adapters included) that lacks a file, tensor or field is "
        "theirs to fix (ValueError, FileNotFoundError, KeyError); every other error is re-raised as it is"
    ),
    ("tinker/loss_bounds.py", "_count"): "operator.index says 'not an integer' by TypeError: a probe, answering None",
}


def _where(path: Path, fn: str | None) -> str:
    rel = path.relative_to(SERVE).as_posix() if path.is_absolute() else path.as_posix()
    return f"{rel}:{fn}" if fn else rel


def _functions(tree: ast.AST):
    """(node, the name of the innermost function holding it) for every node."""
    stack: list[tuple[ast.AST, str | None]] = [(tree, None)]
    while stack:
        node, fn = stack.pop()
        yield node, fn
        inner = node.name if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
        stack += [(child, inner) for child in ast.iter_child_nodes(node)]


def raw_body_reads(path: Path, text: str) -> list[str]:
    found = []
    for node, fn in _functions(ast.parse(text)):
        where = _where(path, fn)
        if where in PARSING or where.split(":")[0] in PARSING:
            continue
        line = f"{where} (line {getattr(node, 'lineno', 0)})"
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in RAW:
            found.append(f"{line}: subscripts the raw {node.value.id}: read the parsed model's attribute")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in RAW
            and node.func.attr in DICT_READS
        ):
            found.append(f"{line}: {node.func.value.id}.{node.func.attr}(...) on the raw JSON: parse it with its model")
        elif isinstance(node, ast.arg) and node.arg in RAW and node.annotation is not None:
            if ast.unparse(node.annotation).startswith("dict"):
                found.append(f"{line}: takes {node.arg} as a dict: take its parsed model")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "json"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "request"
        ):
            found.append(f"{line}: reads request.json() itself: use tinker.routes.read(request, Model)")
    return found


def _caught(handler: ast.ExceptHandler) -> set[str]:
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return {k.id for k in kinds if isinstance(k, ast.Name)} | {k.attr for k in kinds if isinstance(k, ast.Attribute)}


def _blames_the_client(handler: ast.ExceptHandler) -> bool:
    raised = [n.exc for n in ast.walk(handler) if isinstance(n, ast.Raise) and isinstance(n.exc, ast.Call)]
    names = {ast.unparse(r.func).rsplit(".", 1)[-1] for r in raised}  # type: ignore[union-attr]
    return bool(names & USER_ERRORS)


def _bug_handlers(text: str) -> list[tuple[ast.ExceptHandler, str | None]]:
    """The handlers that catch one of BUGS by name, or everything and answer it as the client's error."""
    found = [(node, fn) for node, fn in _functions(ast.parse(text)) if isinstance(node, ast.ExceptHandler)]
    bugs = [
        (h, fn)
        for h, fn in found
        if (h.type is not None and _caught(h) & BUGS)
        or ((h.type is None or _caught(h) & EVERYTHING) and _blames_the_client(h))
    ]
    return sorted(bugs, key=lambda x: x[0].lineno)


def bug_catches(path: Path, text: str) -> list[str]:
    found = []
    for handler, fn in _bug_handlers(text):
        if (_where(path, None), fn) not in ALLOWED:
            names = ", ".join(sorted(_caught(handler) & BUGS)) if handler.type is not None else "everything"
            names = names or ", ".join(sorted(_caught(handler) & EVERYTHING))
            found.append(f"{_where(path, fn)} (line {handler.lineno}): catches {names}: validate the input instead")
    return found


def _sources(*packages: str) -> list[Path]:
    roots = [SERVE / p for p in packages] if packages else [SERVE]
    return sorted(p for root in roots for p in root.rglob("*.py"))


def test_route_modules_read_parsed_bodies_only():
    files = _sources(*ROUTE_PACKAGES)
    assert len(files) > 30
    problems = [v for path in files for v in raw_body_reads(path, path.read_text())]
    assert not problems, "\n".join(problems)


def test_no_serve_module_answers_a_programming_error_as_the_clients():
    files = _sources()
    problems = [v for path in files for v in bug_catches(path, path.read_text())]
    assert not problems, "\n".join(problems)
    present = {(_where(p, None), fn) for p in files for _, fn in _bug_handlers(p.read_text())}
    assert present == set(ALLOWED), (
        f"allowed catches no longer there (drop them from ALLOWED): {set(ALLOWED) - present}"
    )


def test_the_checks_see_each_kind_of_violation():
    route = (
        "async def create(request, t):\n"
        "    raw = await request.json()\n"
        "def save(tenant, body: dict):\n"
        "    name = body['name']\n"
        "    return body.get('path'), body.path\n"
        "def fine(tenant, body: SaveBody):\n"
        "    return body.path, body.tags[0]\n"
    )
    found = [v.split(": ", 1)[1] for v in raw_body_reads(Path("tinker/x.py"), route)]
    assert sorted(found) == sorted(
        [
            "reads request.json() itself: use tinker.routes.read(request, Model)",
            "takes body as a dict: take its parsed model",
            "subscripts the raw body: read the parsed model's attribute",
            "body.get(...) on the raw JSON: parse it with its model",
        ]
    )
    assert raw_body_reads(Path("tinker/bodies.py"), route) == []
    backend = (
        "def run(x):\n"
        "    try:\n"
        "        return x.go()\n"
        "    except (ValueError, KeyError) as e:\n"
        "        raise UserError(str(e))\n"
        "    except builtins.AttributeError:\n"
        "        raise BadRequest('no')\n"
        "    except ValueError:\n"
        "        raise BadRequest('fine: the value the client sent')\n"
        "    except Exception as e:\n"
        "        raise errors.UserError(f'not a valid protobuf: {e}')\n"
        "    except Exception:\n"
        "        log.exception('a bug, logged')\n"
        "        raise\n"
    )
    found = bug_catches(Path("backend/x.py"), backend)
    assert found == [
        "backend/x.py:run (line 4): catches KeyError: validate the input instead",
        "backend/x.py:run (line 6): catches AttributeError: validate the input instead",
        "backend/x.py:run (line 10): catches Exception: validate the input instead",
    ]
    assert bug_catches(Path("core/lora_configs.py"), backend.replace("def run", "def lora_config")) == []
