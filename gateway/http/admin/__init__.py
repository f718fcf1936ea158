"""The operator's web page under /admin (see `page` for its routes and promises)."""

from gateway.http.admin.page import APPROVED_TEXT, PREFIX, AdminPage, AdminSources
from gateway.http.admin.views import TurnWindow

__all__ = ["APPROVED_TEXT", "PREFIX", "AdminPage", "AdminSources", "TurnWindow"]
