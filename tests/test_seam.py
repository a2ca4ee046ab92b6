"""The seam between ECQ and amqtt (``ecq.broker.amqtt_hooks.seam``): every replacement made through it, with amqtt's
original kept and the corrections of each method listed in order; the amqtt version checked at start; every private
amqtt name ECQ reads declared, and present on a real amqtt broker's objects, so an amqtt upgrade fails loudly here."""

from __future__ import annotations

import ast
import asyncio
import inspect
import os
import pathlib
import re
from types import ModuleType
from typing import Any

import pytest
from amqtt.adapters import BufferReader, StreamReaderAdapter, StreamWriterAdapter, WebSocketsReader, WebSocketsWriter
from amqtt.broker import Broker

from ecq.broker import amqtt_hooks
from ecq.broker.amqtt_hooks import seam
from ecq.broker.config_file import prepare
from ecq.broker.plugin import EcqPlugin
from ecq.testing import BrokerProcess, free_port

HOOKS = pathlib.Path(amqtt_hooks.__file__).parent
ROOT = HOOKS.parents[2]


def test_another_amqtt_version_is_refused_naming_both():
    seam.check_amqtt_version()  # the installed one
    with pytest.raises(seam.AmqttSeamError, match=r"ECQ corrects amqtt 0\.12\.1, but amqtt 0\.13\.0 is installed"):
        seam.check_amqtt_version("0.13.0")


def test_a_broker_on_another_amqtt_refuses_to_start(tmp_path, monkeypatch):
    """``ecq broker`` with an amqtt distribution of another version first on its path exits at start, naming both."""
    dist_info = tmp_path / "dist" / "amqtt-0.13.0.dist-info"
    dist_info.mkdir(parents=True)
    dist_info.joinpath("METADATA").write_text("Metadata-Version: 2.1\nName: amqtt\nVersion: 0.13.0\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(dist_info.parent),
                                                                    os.environ.get("PYTHONPATH")])))
    (tmp_path / "broker").mkdir()
    broker = BrokerProcess(tmp_path / "broker")
    try:
        with pytest.raises(RuntimeError, match=r"broker exited with 1:(.|\n)*broker failed to start: ECQ corrects "
                                               r"amqtt 0\.12\.1, but amqtt 0\.13\.0 is installed"):
            broker.start()
    finally:
        if broker.proc is not None and broker.proc.poll() is None:
            broker.kill()
    assert not broker.queues_dir.exists()  # refused before the store was opened


def test_install_refuses_another_amqtt_before_changing_anything(monkeypatch):
    class Owner:
        def method(self) -> str:
            return "amqtt's"

    def correction() -> None:
        seam.replace(Owner, "method", lambda self: "ECQ's")

    monkeypatch.setattr(seam.importlib.metadata, "version", lambda name: "0.13.0" if name == "amqtt" else "")
    with pytest.raises(seam.AmqttSeamError, match="0.13.0"):
        seam.apply([correction])
    assert Owner().method() == "amqtt's" and not seam.is_replaced(Owner, "method")


def test_a_name_missing_on_its_owner_is_a_clear_error():
    class Owner:
        pass

    def replace_what_is_gone() -> None:
        seam.replace(Owner, "_gone", lambda self: None)

    with pytest.raises(seam.AmqttSeamError, match=r"Owner has no _gone, which ECQ's correction "
                                                   r"test_seam\..*replace_what_is_gone replaces"):
        seam.apply([replace_what_is_gone])
    with pytest.raises(seam.AmqttSeamError, match="outside amqtt_hooks.install"):
        seam.replace(Owner, "__init__", lambda self: None)


def test_corrections_wrap_in_table_order_and_the_original_is_kept():
    class Owner:
        def method(self) -> list[str]:
            return ["amqtt"]

    def wrapping(label: str):
        def correction() -> None:
            original = Owner.method
            seam.replace(Owner, "method", lambda self: [label, *original(self)])
        correction.__qualname__ = label
        return correction

    amqtt_method = Owner.method
    seam.apply([wrapping("inner"), wrapping("outer")])
    assert Owner().method() == ["outer", "inner", "amqtt"]
    assert seam.get_original(Owner, "method") is amqtt_method
    assert seam.corrections()["Owner.method"] == ["test_seam.inner", "test_seam.outer"]
    assert "Owner.method\n    test_seam.inner\n    test_seam.outer" in seam.describe()


def test_steps_run_as_the_chain_of_wrappers_would_in_one_wrapper():
    """``seam.step``: the befores of the later corrections first (one replacing the arguments the rest and every after
    gets), amqtt's method, then the afters of the earlier ones first, each run whatever the call or the after before
    it raised (the last exception propagates); the corrections named in table order; one coroutine per call."""
    ran: list[str] = []
    raising: set[str] = set()  # the corrections whose after raises, then whose before raises

    class Owner:
        async def method(self, value: int) -> int:
            ran.append(f"amqtt {value}")
            if value < 0:
                raise ValueError("amqtt's")
            return value

    def correction(label: str, *, adds: int = 0):
        def before(owner: Owner, value: int) -> tuple[Owner, int] | None:
            ran.append(f"before {label} {value}")
            if f"{label} before" in raising:
                raise KeyError(f"{label} before")
            return (owner, value + adds) if adds else None

        def after(owner: Owner, value: int) -> None:
            ran.append(f"after {label} {value}")
            if label in raising:
                raise KeyError(label)

        def install() -> None:
            seam.step(Owner, "method", before=before, always=after)
        install.__qualname__ = label
        return install

    seam.apply([correction("inner"), correction("middle", adds=1), correction("outer")])
    coroutine = Owner().method(1)
    assert asyncio.run(_run(coroutine)) == 2
    assert coroutine.cr_code.co_filename == seam.__file__  # one frame, named as the method it stands for:
    assert coroutine.cr_code.co_qualname == f"{Owner.__qualname__}.method"
    assert ran == ["before outer 1", "before middle 1", "before inner 2", "amqtt 2", "after inner 2",
                   "after middle 2", "after outer 2"]
    assert seam.corrections()["Owner.method"] == ["test_seam.inner", "test_seam.middle", "test_seam.outer"]
    assert ("Owner.method (one wrapper)\n    test_seam.inner\n    test_seam.middle\n    test_seam.outer"
            in seam.describe())

    ran.clear()
    raising.add("inner")
    with pytest.raises(KeyError, match="inner") as raised:
        asyncio.run(Owner().method(-5))
    assert isinstance(raised.value.__context__, ValueError)
    assert ran[-3:] == ["after inner -4", "after middle -4", "after outer -4"]

    ran.clear()
    raising.clear()
    raising.add("middle before")  # its own after is not due; the outer one's is
    with pytest.raises(KeyError, match="middle before"):
        asyncio.run(Owner().method(1))
    assert ran == ["before outer 1", "before middle 1", "after outer 1"]


async def _run(coroutine: Any) -> Any:
    return await coroutine


def test_a_step_answers_in_amqtts_place_replaces_the_result_and_fills_in_amqtts_defaults():
    """A before's ``Result`` skips the inner steps and amqtt (the outer afters still see it), an after's replaces the
    result, a before's ``Instead`` is awaited in their place; befores and afters may be coroutine functions; the
    steps get the arguments all positional (keywords placed, amqtt's defaults filled in)."""
    seen: list[tuple[Any, ...]] = []

    class Owner:
        async def method(self, value: int, qos: int | None = None) -> str:
            seen.append(("amqtt", value, qos))
            return f"amqtt {value}"

    async def answer_negatives(owner: Owner, value: int, qos: int | None) -> seam.Result | seam.Instead | None:
        await asyncio.sleep(0)
        if value == 0:
            return seam.Instead(_run(owner.other_answer()))
        return seam.Result("answered") if value < 0 else None

    def note(result: str, owner: Owner, value: int, qos: int | None) -> None:
        seen.append(("inner after", result, qos))

    async def shout(result: str, owner: Owner, value: int, qos: int | None) -> seam.Result:
        return seam.Result(result.upper())

    async def other_answer() -> str:
        return "instead"

    Owner.other_answer = staticmethod(other_answer)

    def inner() -> None:
        seam.step(Owner, "method", after=note)

    def middle() -> None:
        seam.step(Owner, "method", before=answer_negatives)

    def outer() -> None:
        seam.step(Owner, "method", after=shout)

    seam.apply([inner, middle, outer])
    assert asyncio.run(Owner().method(1)) == "AMQTT 1"
    assert seen == [("amqtt", 1, None), ("inner after", "amqtt 1", None)]
    seen.clear()
    assert asyncio.run(Owner().method(-1, qos=1)) == "ANSWERED"
    assert asyncio.run(Owner().method(0)) == "INSTEAD"
    assert seen == []  # neither amqtt nor the step inside the answering one


def test_a_plain_method_and_a_classmethod_are_corrected_by_one_wrapper_of_their_kind():
    class Owner:
        def plain(self, value: int) -> list[str]:
            return [f"amqtt {value}"]

        @classmethod
        async def made(cls, value: int) -> str:
            return f"{cls.__name__} {value}"

    def body(owner: Owner, value: int) -> list[str]:
        return [f"body {value}"]

    def double(owner: Owner, value: int) -> tuple[Owner, int]:
        return owner, value * 2

    async def awaited(owner: Owner, value: int) -> None:
        return None

    def correct() -> None:
        seam.step(Owner, "plain", body=body)
        seam.step(Owner, "plain", before=double)
        seam.step(Owner, "made", before=lambda cls, value: (cls, value + 1))
        seam.step(Owner, "made", after=lambda result, cls, value: seam.Result(f"{result}!"))

    def await_in_a_plain_method() -> None:
        seam.step(Owner, "plain", before=awaited)

    seam.apply([correct])
    assert Owner().plain(2) == ["body 4"]
    assert asyncio.run(Owner.made(1)) == "Owner 2!"
    assert isinstance(inspect.getattr_static(Owner, "made"), classmethod)
    with pytest.raises(seam.AmqttSeamError, match="given a coroutine function where it calls a plain one"):
        seam.apply([await_in_a_plain_method])


def test_every_amqtt_method_corrected_more_than_once_is_one_wrapper():
    """issue 32's one table: each amqtt method ECQ corrects several times is installed as ONE wrapper of the seam
    running those corrections in order (``seam.step``), never as a chain of wrappers, one frame per correction."""
    amqtt_hooks.install(EcqPlugin)
    chains = sorted(target for target, names in seam.corrections().items()
                    if len(names) > 1 and not target.startswith("Owner."))
    one_wrapper = {f"{owner.__name__}.{name}": (owner, name) for owner, name in seam._steps}
    assert [target for target in chains if target not in one_wrapper] == []
    for target in chains:
        installed = inspect.getattr_static(*one_wrapper[target])
        assert getattr(installed, "__func__", installed).__code__.co_filename == seam.__file__, target
        assert f"{target} (one wrapper)" in seam.describe()


def test_a_body_replaces_amqtts_method_only_as_the_first_step_and_a_method_has_one_kind_of_correction():
    class Owner:
        async def method(self) -> str:
            return "amqtt's"

        async def other(self) -> str:
            return "amqtt's"

    async def body(owner: Owner) -> str:
        return "ECQ's"

    def replaced_body() -> None:
        seam.step(Owner, "method", body=body)

    def late_body() -> None:
        seam.step(Owner, "method", body=body)

    def wrapped() -> None:
        seam.replace(Owner, "other", Owner.other)

    def stepped_after_a_wrapper() -> None:
        seam.step(Owner, "other", before=lambda owner: None)

    def wrapped_after_steps() -> None:
        seam.replace(Owner, "method", Owner.method)

    seam.apply([replaced_body])
    assert asyncio.run(Owner().method()) == "ECQ's"
    for correction, problem in ((late_body, "body replaced by an earlier correction's step"),
                                (stepped_after_a_wrapper, "replaced through seam.replace"),
                                (wrapped_after_steps, "must give its correction as a step too")):
        with pytest.raises(seam.AmqttSeamError, match=problem):
            seam.apply([wrapped, correction] if correction is stepped_after_a_wrapper else [correction])


@pytest.mark.timeout(30)
async def test_a_connection_holds_one_ecq_frame_for_each_method_it_stays_in(tmp_path):
    """amqtt's ``_client_connected``, ``_handle_client_session`` and ``_reader_loop`` stay suspended for a connection's
    whole life, so each wrapper of theirs is a coroutine frame per connected client (8 of them, about 3 KB, with one
    wrapper per correction for the first two): a persistent client's connection, in an in-process ECQ broker, holds
    one ECQ frame above each (and fleet_scale's body and the framer in place of amqtt's)."""
    port = free_port()
    broker = Broker(prepare(None, bind=f"127.0.0.1:{port}", data_dir=tmp_path, admin_bind=f"127.0.0.1:{free_port()}"))
    await broker.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"\x10\x12\x00\x04MQTT\x04\x00\x00\x3c\x00\x06frames")  # clean session 0
        assert await asyncio.wait_for(reader.readexactly(4), 10) == b"\x20\x02\x00\x00"
        chain: list[str] = []
        while not any(name.endswith("client_message_loop") for name in chain):  # the task reaches its loop
            await asyncio.sleep(0.01)
            chain = next((names for task in asyncio.all_tasks() if "amqtt Broker.stream_connected" in
                          (names := _awaited(task.get_coro()))), [])
        amqtts = chain.index("amqtt Broker._client_connected")
        loop = next(n for n, name in enumerate(chain) if name.endswith("client_message_loop"))
        above_client_connected = chain[chain.index("amqtt Broker.stream_connected") + 1:amqtts]
        above_the_loop = chain[amqtts + 1:loop]
        assert above_client_connected == ["seam Broker._client_connected"], chain
        assert above_the_loop == ["seam Broker._handle_client_session", "fleet_scale "
                                  "connect_without_walking_every_filter.<locals>.handle_client_session"], chain
        reader = next(_awaited(task.get_coro()) for task in asyncio.all_tasks()
                      if task.get_coro().cr_code.co_qualname.endswith("_reader_loop"))
        assert reader[:2] == ["seam BrokerProtocolHandler._reader_loop",  # one wrapper, awaiting the framer itself
                              "framer Framer.run"], reader
        writer.close()
    finally:
        await broker.shutdown()


def _awaited(coroutine: Any) -> list[str]:
    """``"module qualname"`` of ``coroutine`` and of each coroutine it awaits in turn, outermost first, as far as the
    one the task stands in (its ``cr_await`` no coroutine)."""
    names = []
    while hasattr(coroutine, "cr_code"):
        module = pathlib.Path(coroutine.cr_code.co_filename).stem
        names.append(f"{'amqtt' if '/amqtt/' in coroutine.cr_code.co_filename else module} "
                     f"{coroutine.cr_code.co_qualname}")
        coroutine = coroutine.cr_await
    return names


def test_install_records_every_replacement_of_amqtt():
    amqtt_hooks.install(EcqPlugin)
    table = seam.corrections()
    replacements = sum(len(re.findall(r"^\s+(?:replace|step)\(", path.read_text(), re.M))
                       for path in HOOKS.glob("*.py"))
    assert sum(len(names) for key, names in table.items() if not key.startswith("Owner.")) == replacements
    correction_names = {f"{c.__module__.rsplit('.', 1)[-1]}.{c.__name__}" for c in amqtt_hooks.CORRECTIONS}
    for (owner, name), original in seam.saved.items():
        if isinstance(owner, ModuleType):  # a name an amqtt module looks up, such as its Queue
            assert owner.__name__.startswith("amqtt") and set(table[f"{owner.__name__}.{name}"]) <= correction_names
        elif owner.__module__.startswith("amqtt"):
            assert getattr(original, "__func__", original).__module__.startswith("amqtt"), (owner, name)
            assert set(table[f"{owner.__name__}.{name}"]) <= correction_names
    assert table["BrokerProtocolHandler.init_from_connect"][-1] == "mqtt5_edge.translate_level_5_connects"


def test_no_hook_assigns_an_amqtt_attribute_behind_the_seam():
    """A new correction writes ``replace(Owner, "name", replacement)``, never ``Owner.name = replacement``."""
    behind = [f"{path.name}:{number}" for path in HOOKS.glob("*.py")
              for number, line in enumerate(path.read_text().splitlines(), 1)
              if re.match(r"\s+[A-Z]\w*\.\w+ = ", line)]
    assert behind == []


def test_amqtt_hooks_import_nothing_of_the_broker_above_them():
    """The import rule of docs/architecture.md: no circle through ``plugin``, ``cluster_state`` or ``bus``."""
    allowed = ("ecq.broker.amqtt_hooks", "ecq.broker.acl", "ecq.queue", "ecq.store.protocol", "ecq.config")
    imported = {f"{path.name}: {node.module}" for path in HOOKS.glob("*.py")
                for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)
                and node.module and node.module.startswith("ecq") and not node.module.startswith(allowed)}
    assert imported == set()


def test_every_private_amqtt_name_ecq_reads_is_declared():
    """``x._name`` read in amqtt_hooks is either ECQ's own (defined somewhere in ecq/) or in ``seam.PRIVATE_READS``;
    what ``PRIVATE_READS`` declares is read somewhere. Outside amqtt_hooks nothing reads a declared name."""
    declared = {name for names in seam.PRIVATE_READS.values() for name in names}
    own = set().union(*(_defined(path) for path in ROOT.joinpath("ecq").rglob("*.py")))
    read = set().union(*(_private_reads(path) for path in HOOKS.glob("*.py")))
    assert read - own - declared == set()
    assert declared - read == set()
    outside = {f"{path.relative_to(ROOT)}: {name}" for path in ROOT.joinpath("ecq").rglob("*.py")
               if HOOKS not in path.parents for name in _private_reads(path) & (declared - own)}
    assert outside == set()


def _private_reads(path: pathlib.Path) -> set[str]:
    """``x._name`` read in ``path``, and each private name it corrects through ``seam.step`` (given as a string)."""
    tree = ast.parse(path.read_text())
    read = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Load) and re.match(r"_[a-z]", node.attr)}
    stepped = {node.args[1].value for node in ast.walk(tree) if isinstance(node, ast.Call)
               and isinstance(node.func, ast.Name) and node.func.id == "step"
               and isinstance(node.args[1], ast.Constant) and re.match(r"_[a-z]", node.args[1].value)}
    return read | stepped


def _defined(path: pathlib.Path) -> set[str]:
    """Private names a module of ECQ defines: functions, attributes and variables it assigns, setattr's names."""
    defined: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            defined.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"_[a-z]\w*", node.value):
            defined.add(node.value)  # a name given to setattr/getattr
    return defined


@pytest.mark.timeout(30)
async def test_every_declared_read_exists_on_a_real_amqtt_broker():
    """Each name of ``seam.PRIVATE_READS`` on the objects of a stock amqtt broker serving one TCP client (the
    WebSocket adapters and BufferReader built directly)."""
    port = free_port()
    broker = Broker({"listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{port}"}}})
    await broker.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"\x10\x10\x00\x04MQTT\x04\x02\x00\x3c\x00\x04seam")
        assert await asyncio.wait_for(reader.readexactly(4), 10) == b"\x20\x02\x00\x00"
        _session, handler = broker._sessions["seam"]
        instances = {"amqtt.broker.Broker": broker, "amqtt.broker.BrokerContext": broker.plugins_manager.context,
                     "amqtt.session.Session": handler.session,
                     "amqtt.mqtt.protocol.handler.ProtocolHandler": handler,
                     "amqtt.mqtt.protocol.broker_handler.BrokerProtocolHandler": handler,
                     "amqtt.plugins.manager.PluginManager": broker.plugins_manager,
                     "amqtt.adapters.StreamReaderAdapter": handler.reader,
                     "amqtt.adapters.StreamWriterAdapter": handler.writer,
                     "amqtt.adapters.BufferReader": BufferReader(b""),
                     "amqtt.adapters.WebSocketsReader": WebSocketsReader(None),
                     "amqtt.adapters.WebSocketsWriter": WebSocketsWriter(None),
                     "asyncio.StreamReader": handler.reader._reader,
                     "asyncio.StreamWriter": handler.writer._writer,
                     "asyncio.StreamReaderProtocol": handler.writer._writer._protocol}
        assert isinstance(handler.reader, StreamReaderAdapter) and isinstance(handler.writer, StreamWriterAdapter)
        missing = [f"{owner}.{name}" for owner, names in seam.PRIVATE_READS.items() for name in names
                   if not hasattr(instances[owner], name)]
        assert missing == []
        writer.close()
    finally:
        await broker.shutdown()
