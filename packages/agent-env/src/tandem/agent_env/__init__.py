"""Sandboxed multi-turn software-engineering environments.

An agent edits a repository snapshot through tools, in a sandbox with no network and strict
limits; the reward comes from hidden tests. No torch needed.
"""

from importlib.metadata import version as _version

from tandem.agent_env.config import EnvConfig, SandboxConfig, SandboxLimits
from tandem.agent_env.env import Env
from tandem.agent_env.errors import PolicyError, SandboxError, TaskFileError
from tandem.agent_env.grading import GradeResult
from tandem.agent_env.openai_policy import OpenAIPolicy
from tandem.agent_env.opening import opening_messages
from tandem.agent_env.oracle import OraclePolicy, oracle_script, submit_at_once
from tandem.agent_env.replies import TEXT_ANSWER_OBSERVATION
from tandem.agent_env.rollout import Policy, run_episode, run_episodes
from tandem.agent_env.task import HiddenCase, HiddenTests, ReferenceEdit, Task, TaskLimits
from tandem.agent_env.tasks.generate import check_task_family, generate_tasks
from tandem.agent_env.tasks.multibug import check_multibug_family, generate_multibug_tasks
from tandem.agent_env.tasks.stdlib import stdlib_tasks
from tandem.agent_env.tasks.swebench import load_tasks
from tandem.agent_env.tools import READ_ONLY_TOOLS, ToolCall, tool_schemas
from tandem.agent_env.trajectory import (
    Observation,
    StepRecord,
    StepResult,
    Trajectory,
    read_jsonl,
    render_text,
    write_jsonl,
)

__version__ = _version("tandem-agent-env")

__all__ = [
    "READ_ONLY_TOOLS",
    "TEXT_ANSWER_OBSERVATION",
    "Env",
    "EnvConfig",
    "GradeResult",
    "HiddenCase",
    "HiddenTests",
    "Observation",
    "OpenAIPolicy",
    "OraclePolicy",
    "Policy",
    "PolicyError",
    "ReferenceEdit",
    "SandboxConfig",
    "SandboxError",
    "SandboxLimits",
    "StepRecord",
    "StepResult",
    "Task",
    "TaskFileError",
    "TaskLimits",
    "ToolCall",
    "Trajectory",
    "check_multibug_family",
    "check_task_family",
    "generate_multibug_tasks",
    "generate_tasks",
    "load_tasks",
    "opening_messages",
    "oracle_script",
    "read_jsonl",
    "render_text",
    "run_episode",
    "run_episodes",
    "stdlib_tasks",
    "submit_at_once",
    "tool_schemas",
    "write_jsonl",
]
