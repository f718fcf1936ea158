"""Long-term memory per scope: MEMORY.md facts, HISTORY.md log, knowledge base, search.

The public surface: `MemoryStore` (a manager per session key, by scope mode),
`MemoryManager` (the files of one scope), `KnowledgeBase`/`KnowledgeEntry`, and the
`SearchIndex` they share. Consolidation (asking the LLM for facts) lives elsewhere and
records its result through `MemoryManager.record_consolidation`.
"""

from gateway.memory.format import CATEGORIES, DEFAULT_CATEGORY
from gateway.memory.index import SearchHit, SearchIndex
from gateway.memory.knowledge import KnowledgeBase, KnowledgeEntry
from gateway.memory.manager import MemoryManager
from gateway.memory.scopes import WORKSPACE_SCOPE, ScopeMode
from gateway.memory.store import MemoryStore

__all__ = [
    "CATEGORIES",
    "DEFAULT_CATEGORY",
    "WORKSPACE_SCOPE",
    "KnowledgeBase",
    "KnowledgeEntry",
    "MemoryManager",
    "MemoryStore",
    "ScopeMode",
    "SearchHit",
    "SearchIndex",
]
