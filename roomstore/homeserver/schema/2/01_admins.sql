-- Server admins: only they may call the admin API (/_synapse/admin/...), e.g. to purge history or a room.
-- Made with `roomstore homeserver --make-admin @user:server` (docs: README, "Run a homeserver").
ALTER TABLE hs_users ADD COLUMN admin BOOLEAN NOT NULL DEFAULT FALSE;
