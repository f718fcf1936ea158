-- Where each conversation of a platform that keeps nothing for an absent bot (Discord's
-- Gateway) was read up to: the channel's backfill after a (re)connect starts after it
-- (gateway.cursors). Written by the replica holding the platform's connection.
CREATE TABLE gw_channel_cursors (
    channel      text NOT NULL,
    conversation text NOT NULL,
    position     text NOT NULL,
    updated_at   double precision NOT NULL,
    PRIMARY KEY (channel, conversation)
);
