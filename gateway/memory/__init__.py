"""Long-term memory per scope: MEMORY.md facts, HISTORY.md log, knowledge base, search.

The public surface: `MemoryStore` (a manager per session key, by scope mode),
`MemoryManager` (the files of one scope), `KnowledgeBase`/`KnowledgeEntry`, and the
`SearchIndex` they share. Consolidation (asking the LLM for facts) lives elsewhere and
records its result through `MemoryManager.record_consolidation`.

The names are imported on first use: `gateway.memory.scopes`, which every command's
workspace check needs, does not bring numpy and the search index along.
"""

from typing import TYPE_CHECKING

from gateway.lazy import lazy_exports

if TYPE_CHECKING:
    from gateway.memory.format import CATEGORIES, DEFAULT_CATEGORY
    from gateway.memory.index import SearchHit, SearchIndex
    from gateway.memory.knowledge import KnowledgeBase, KnowledgeEntry
    from gateway.memory.manager import MemoryManager
    from gateway.memory.scopes import WORKSPACE_SCOPE, ScopeMode
    from gateway.memory.store import MemoryStore

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "format": ("CATEGORIES", "DEFAULT_CATEGORY"),
        "index": ("SearchHit", "SearchIndex"),
        "knowledge": ("KnowledgeBase", "KnowledgeEntry"),
        "manager": ("MemoryManager",),
        "scopes": ("WORKSPACE_SCOPE", "ScopeMode"),
        "store": ("MemoryStore",),
    },
)

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
