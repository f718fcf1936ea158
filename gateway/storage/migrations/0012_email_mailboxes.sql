-- How far the email channel has read each mailbox (channels.email.state): the folder's
-- UIDVALIDITY and the highest UID taken into the journal. Shared by the replicas, so the
-- one that takes the mailbox over goes on where the previous one stopped.
CREATE TABLE gw_email_mailboxes (
    mailbox     text PRIMARY KEY,
    uidvalidity bigint NOT NULL,
    last_uid    bigint NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
