"""`gateway people link|unlink|list`: the operator's answers, over any `PeopleStore`."""

from __future__ import annotations

from gateway.people.protocol import PeopleError, PeopleStore, parse_sender_id


def cli_link(people: PeopleStore, raw_ids: list[str]) -> str:
    if len(raw_ids) < 2:
        raise PeopleError(
            "link needs two or more ids, e.g. gateway people link telegram:42 slack:U123"
        )
    ids = [parse_sender_id(raw) for raw in raw_ids]
    person = people.link(ids)
    members = people.people().get(person, ids)
    return f"linked as one person ({person}): {', '.join(members)}"


def cli_unlink(people: PeopleStore, raw_id: str) -> str:
    sender = parse_sender_id(raw_id)
    if not people.unlink(sender):
        raise PeopleError(
            f"{sender} is not linked to anyone; `gateway people list` shows the links"
        )
    return f"unlinked {sender}"


def cli_list(people: PeopleStore) -> str:
    found = people.people()
    if not found:
        return "No linked people yet (gateway people link ID ID ...)."
    return "\n".join(f"{person}: {' '.join(ids)}" for person, ids in found.items())
