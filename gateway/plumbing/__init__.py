"""What the state packages build on to keep their state: PostgreSQL's pools and numbered
migrations (`postgres`), the lease epochs every shared-mode write is fenced by (`fence`),
the shape of a channel's own store in either mode (`backends`) and what every kind of
state's import and export share (`items`). Below the state packages; the storage seam
(`gateway.storage`), which opens those packages' stores, sits above them."""
