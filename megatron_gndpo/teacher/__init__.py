"""The teachers: one :class:`Teacher` protocol and its kinds (``teacher/base.py`` says which
module holds each); ``build.py`` makes a run's teachers from its config."""

from megatron_gndpo.teacher.base import Teacher
from megatron_gndpo.teacher.cross_tokenizer import CrossTokenizer
from megatron_gndpo.teacher.local import LocalTeacher
from megatron_gndpo.teacher.routed import Routing, TeacherSet
from megatron_gndpo.teacher.served import ServedTeacher

__all__ = ["CrossTokenizer", "LocalTeacher", "Routing", "ServedTeacher", "Teacher", "TeacherSet"]
