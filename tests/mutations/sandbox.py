"""Mutation rows for the sandboxed workers (reward and tool pools) and the tools (see :mod:`tests.mutations`)."""

from __future__ import annotations

from tests.mutations.row import Mutation

ROWS = (
    Mutation(
        "scorers may start processes",
        "reward workers are daemons (multiprocessing in a scorer fails)",
        "asyncrl/sandbox/process.py",
        "            daemon=False,  # see the module's docstring; the pool's finalizer stops it",
        "            daemon=True,",
        ("tests/test_sandbox_workers.py",),
    ),
    Mutation(
        "a worker's answer is its job's",
        "an answer is taken whatever job it names",
        "asyncrl/sandbox/process.py",
        "            if isinstance(message, tuple) and len(message) == 2 and message[0] == seq:",
        "            if isinstance(message, tuple) and len(message) == 2:",
        ("tests/test_sandbox_workers.py",),
    ),
    Mutation(
        "scorer memory is capped",
        "a scorer process may grow without bound",
        "asyncrl/sandbox/child.py",
        "        limit_memory(cap.mb)",
        "        pass",
        ("tests/test_sandbox_memory.py",),
    ),
    Mutation(
        "what a scorer left running dies with a killed server",
        "a scorer's child outlives a SIGKILLed rollout server",
        "asyncrl/sandbox/child.py",
        "    start_reaper()\n",
        "    pass\n",
        ("tests/test_sandbox_workers.py",),
    ),
    Mutation(
        "tool memory is capped",
        "a tool process may grow without bound",
        "asyncrl/tools/pool.py",
        "            memory_cap=MemoryCap(max_memory_mb, MEMORY_KEY),",
        "            memory_cap=MemoryCap(0, MEMORY_KEY),",
        ("tests/test_tool_metrics.py",),
    ),
    Mutation(
        "a tool answer without text is an empty answer",
        "a ToolResponse with text None is an invalid response",
        "asyncrl/tools/calls.py",
        "    if text is None or (text is _NO_TEXT and media):",
        "    if text is _NO_TEXT and media:",
        ("tests/test_tool_verl_ports.py",),
    ),
    Mutation(
        "tool calls' wait for a worker is measured",
        "queue waits are never counted",
        "asyncrl/tools/pool.py",
        "            self._total_s += seconds\n",
        "            pass\n",
        ("tests/test_tool_queue.py",),
    ),
    Mutation(
        "a worker's output is bounded",
        "a worker writes to the caller's stdout and stderr unbounded",
        "asyncrl/sandbox/child.py",
        "        redirect_output(*outputs)\n",
        "        pass\n",
        (
            "tests/test_sandbox_output.py::test_what_a_tool_writes_reaches_the_servers_output_only_up_to_the_cap",
        ),
    ),
    Mutation(
        "a tool that exits while starting is named",
        "sys.exit() in a tool's __init__ ends the worker unnamed",
        "asyncrl/tools/config.py",
        "        except (Exception, SystemExit) as exc:  # sys.exit() in __init__ too, named here\n",
        "        except Exception as exc:  # sys.exit() in __init__ too, named here\n",
        ("tests/test_sandbox_output.py::test_a_tool_that_calls_sys_exit_while_starting_is_named",),
    ),
    Mutation(
        "a tool that exits while starting is named",
        "sys.exit() at a scorer's import ends the worker unnamed",
        "asyncrl/sandbox/child.py",
        "    except (Exception, SystemExit) as exc:\n",
        "    except Exception as exc:\n",
        (
            "tests/test_sandbox_output.py::test_a_scorer_that_calls_sys_exit_on_import_is_reported_with_its_message",
        ),
    ),
    Mutation(
        "a tool that exits while starting is named",
        "the worker is killed before its exit code is read (-9 reported)",
        "asyncrl/sandbox/process.py",
        "            self.process.join(STOP_GRACE_S)\n            code = self.process.exitcode\n",
        "            self.kill()\n            code = self.process.exitcode\n",
        (
            "tests/test_sandbox_output.py::test_a_worker_that_exits_while_starting_reports_its_own_exit_code",
        ),
    ),
    Mutation(
        "a tool config a server would refuse is named at launch",
        "a veRL tool config (or an unreadable one) passes the launch checks and each server fails at its start",
        "asyncrl/config/inputs.py",
        "            problems += launch_problems(mt.tool_config_path)",
        "            pass",
        ("tests/test_tool_verl_ports.py",),
    ),
    Mutation(
        "a tool whose package is missing is named at launch",
        "a tool class of a package not installed (veRL's) passes the launch checks",
        "asyncrl/tools/config.py",
        "        if importlib.util.find_spec(top) is None:",
        "        if False:",
        ("tests/test_tool_verl_ports.py",),
    ),
    Mutation(
        "a given-up turn's waiting calls are not run",
        "a turn given up while its calls wait for a worker still runs them all",
        "asyncrl/tools/pool.py",
        "            if dropped is not None and dropped.is_set():  # its turn was given up meanwhile",
        "            if False:",
        ("tests/test_tool_queue.py",),
    ),
    Mutation(
        "a reward part no trajectory can carry is left out",
        "a part named in over 256 characters is kept (its group cannot be sent, dealt again and given up)",
        "asyncrl/rewards/registry.py",
        "            if len(name) > MAX_SHORT_STR:  # a trajectory could not carry it: its group was lost",
        "            if False:",
        ("tests/test_reward_values.py",),
    ),
    Mutation(
        "the first failure of each kind is logged",
        "twenty failures of one kind hide the first of every other kind",
        "asyncrl/sandbox/workers.py",
        "            first = variant not in self._logged and of_kind < MAX_LOGGED",
        "            first = variant not in self._logged and len(self._logged) < MAX_LOGGED",
        (
            "tests/test_sandbox_workers.py::"
            "test_the_first_failure_of_each_kind_is_logged_however_many_others_came",
        ),
    ),
    Mutation(
        "an unreadable RuntimeError does not kill a capped worker",
        "the memory cap's check reads str() of the user's exception unguarded",
        "asyncrl/sandbox/memory.py",
        '    try:\n        return str(exc)\n    except Exception:\n        return ""',
        "    return str(exc)",
        (
            "tests/test_sandbox_workers.py::test_sys_exit_and_unprintable_exceptions_do_not_end_the_worker",
        ),
    ),
    Mutation(
        "tool call blocks are found in one pass",
        "the blocks are found by a lazy regular expression, which rescans from every open tag",
        "asyncrl/tools/hermes.py",
        "    pos = 0\n    while (start := text.find(OPEN_TAG, pos)) >= 0:",
        "    import re\n\n"
        '    lazy = re.escape(OPEN_TAG) + r"(.*?)" + re.escape(CLOSE_TAG)\n'
        "    for m in re.finditer(lazy, text, re.DOTALL):\n"
        "        yield m.start(), m.end(), m.group(1)\n"
        "    pos = len(text)\n"
        "    while (start := text.find(OPEN_TAG, pos)) >= 0:",
        (
            "tests/test_tool_text.py::test_tool_call_blocks_are_found_in_one_pass_as_the_lazy_match_found_them",
        ),
    ),
)
