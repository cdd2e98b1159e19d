"""The program one tool call runs as, in a sandbox of its own (rlvr.envs.tools): it imports the
tool's module from the source that came with the call, calls the function once with the call's
arguments, and answers with one line: the value as strict plain data (rlvr.verifiers.harness's
`encode`), or what went wrong. Standard library only: this file's source is the sandbox's main.py,
followed by `main(<request>)`.

The request (a JSON object) holds `harness` (the source of rlvr.verifiers.harness), `modules`
({dotted name: source}: the tool's module), `function` ("pkg.module:fn") and `arguments` (a JSON
object); a tool passed as an object comes as `pickled` (base64 of the function pickled by value),
`modules` holding cloudpickle's module that unpickles it. The modules are imported from memory,
under their own names, with empty parent packages; they see the standard library and nothing else
(the sandbox's python runs with -I -S). What the tool prints goes to stderr, which the caller
ignores.
"""

import base64
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import pickle
import sys
import types


class SourceFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports the modules of `sources` ({dotted name: source}) from memory."""

    def __init__(self, sources: dict) -> None:
        self.sources = sources

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.sources:
            return None
        return importlib.util.spec_from_loader(fullname, self, origin=fullname)

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        filename = module.__name__.replace(".", "/") + ".py"
        exec(compile(self.sources[module.__name__], filename, "exec"), module.__dict__)


def install(sources: dict) -> None:
    """Make `sources` importable, each parent package an empty one unless it has a source."""
    for name in sources:
        parts = name.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent not in sources and parent not in sys.modules:
                package = types.ModuleType(parent)
                package.__path__ = []
                package.__spec__ = importlib.machinery.ModuleSpec(parent, None, is_package=True)
                sys.modules[parent] = package
    sys.meta_path.insert(0, SourceFinder(sources))


def load_function(request: dict):
    """The tool's function: unpickled, or imported from the module its "pkg.module:fn" names."""
    if "pickled" in request:
        return pickle.loads(base64.b64decode(request["pickled"]))
    module_name, _, qualname = request["function"].partition(":")
    function = importlib.import_module(module_name)
    for part in qualname.split("."):
        function = getattr(function, part)
    return function


def main(request_json: str) -> None:
    """Run the call `request_json` describes and write its one reply line (see the module)."""
    request = json.loads(request_json)
    install({"rlvr.verifiers.harness": request["harness"], **request["modules"]})
    harness = importlib.import_module("rlvr.verifiers.harness")
    _inbox, outbox = harness._channel()  # replies on a private copy of stdout; prints to stderr
    try:
        function = load_function(request)
    except BaseException as err:
        reply = {"import_failed": f"{type(err).__name__}: {err}"[:2000]}
    else:
        try:
            value = function(**request["arguments"])
        except BaseException as err:
            reply = {"raised": type(err).__name__, "message": str(err)[:2000]}
        else:
            try:
                reply = {"value": harness.encode(value)}
            except TypeError as err:
                reply = {"not_plain": str(err)}
    harness._say(outbox, json.dumps(reply))
    os._exit(0)  # no atexit hooks or lingering threads of the tool's
