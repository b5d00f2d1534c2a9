-- Filters a client uploaded (POST /user/{userId}/filter), numbered per user from 0.
CREATE TABLE hs_filters (
    user_id TEXT NOT NULL,
    filter_id BIGINT NOT NULL,
    filter_json TEXT NOT NULL,
    PRIMARY KEY (user_id, filter_id)
);
