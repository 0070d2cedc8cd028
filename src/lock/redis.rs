//! Redis leases: `SET key token NX PX ttl`, released and extended only by their owner.

use std::time::Duration;

use async_trait::async_trait;
use redis::{Script, aio::ConnectionManager};
use sea_orm::{DatabaseConnection, DatabaseTransaction};
use tokio::time::{Instant, timeout};

use super::{
    LocalLock,
    backoff::Backoff,
    fence, holder,
    name::LockName,
    traits::{Acquired, Fencing, LeaseLock, LockGuard, Renewal},
};
use crate::{error::LockError, schema::MAX_STORED_NAME};

const KIND: &str = "redis";
/// Longest a single Redis call may take before the server counts as unreachable.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);

const RELEASE: &str = r#"if redis.call("get", KEYS[1]) == ARGV[1] then return redis.call("del", KEYS[1]) else return 0 end"#;
const EXTEND: &str = r#"if redis.call("get", KEYS[1]) == ARGV[1] then return redis.call("pexpire", KEYS[1], ARGV[2]) else return 0 end"#;

/// A lease in Redis (one node): `SET freshlock:{name} token NX PX ttl`, polled with short jittered
/// backoff; released and extended by a Lua compare-and-delete / compare-and-expire so only the
/// owner's token can. A crashed holder's lease runs out by its TTL.
///
/// A Redis lock is an efficiency lock: a holder paused past its TTL loses it without knowing. So
/// every grant takes a fence from the `freshlock_lock` table of the data's database (not from a
/// Redis counter, which a Redis restart without persistence would reset and so freeze every later
/// write), and `locked_update` checks it in the transaction of its write.
///
/// Connections: one multiplexed, auto-reconnecting connection ([`ConnectionManager`]) carries all
/// concurrent calls — Redis's pipelining makes a pool unnecessary. Cheap to clone.
#[derive(Clone)]
pub struct RedisLock {
    redis: ConnectionManager,
    fences: DatabaseConnection,
    /// This backend's in-process queue (see [`LockBackend::queue`]), shared by its clones.
    queue: LocalLock,
}

impl std::fmt::Debug for RedisLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisLock").finish_non_exhaustive()
    }
}

impl RedisLock {
    /// Connects to the Redis server at `url`; fences live in `fences` (the data's database).
    ///
    /// # Errors
    /// [`LockError::Backend`] when the URL is invalid or the server does not answer in 2 s.
    pub async fn connect(url: &str, fences: DatabaseConnection) -> Result<Self, LockError> {
        let client = redis::Client::open(url).map_err(fail)?;
        // One plain connection and a PING first: a server that refuses (`maxclients`, a wrong
        // password) says why here, where the connection manager would only retry until the
        // timeout.
        let probe = async {
            let mut connection = client.get_multiplexed_async_connection().await?;
            redis::cmd("PING")
                .query_async::<String>(&mut connection)
                .await
        };
        match timeout(CALL_TIMEOUT, probe).await {
            Err(_) => return Err(unreachable_server()),
            Ok(Err(e)) => {
                return Err(match refusal(&client).await {
                    Some(reason) => LockError::Backend {
                        backend: KIND,
                        source: format!("redis refused the connection: {reason}").into(),
                    },
                    None => fail(e),
                });
            }
            Ok(Ok(_)) => {}
        }
        let redis = timeout(CALL_TIMEOUT, ConnectionManager::new(client))
            .await
            .map_err(|_| unreachable_server())?
            .map_err(fail)?;
        Ok(Self {
            redis,
            fences,
            queue: LocalLock::new(),
        })
    }

    fn key(name: &LockName) -> String {
        format!("freshlock:{name}")
    }
}

fn fail(e: redis::RedisError) -> LockError {
    LockError::Backend {
        backend: KIND,
        source: Box::new(e),
    }
}

/// What a server that closes new connections at once says first (`-ERR max number of clients
/// reached`): a refusal the client library reports only as a broken pipe.
async fn refusal(client: &redis::Client) -> Option<String> {
    use tokio::io::AsyncReadExt;
    let redis::ConnectionAddr::Tcp(host, port) = client.get_connection_info().addr() else {
        return None;
    };
    let read = async {
        let mut stream = tokio::net::TcpStream::connect((host.as_str(), *port))
            .await
            .ok()?;
        let mut said = vec![0u8; 256];
        let n = stream.read(&mut said).await.ok()?;
        let said = String::from_utf8_lossy(&said[..n]).trim().to_owned();
        said.strip_prefix('-').map(str::to_owned)
    };
    timeout(Duration::from_millis(500), read)
        .await
        .ok()
        .flatten()
}

fn unreachable_server() -> LockError {
    LockError::Backend {
        backend: KIND,
        source: "redis did not answer within 2 s".into(),
    }
}

async fn call<T>(future: impl Future<Output = redis::RedisResult<T>>) -> Result<T, LockError> {
    timeout(CALL_TIMEOUT, future)
        .await
        .map_err(|_| unreachable_server())?
        .map_err(fail)
}

super::outside::outside_backend!(RedisLock, Redis, Lease);

#[async_trait]
impl LeaseLock for RedisLock {
    async fn acquire(&self, name: &LockName, wait: Duration, ttl: Duration) -> Acquired {
        let key = Self::key(name);
        let token = holder::new_token();
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
        let deadline = Instant::now() + wait;
        let mut backoff = Backoff::new();
        let mut redis = self.redis.clone();
        loop {
            let set: Option<String> = call(
                redis::cmd("SET")
                    .arg(&key)
                    .arg(&token)
                    .arg("NX")
                    .arg("PX")
                    .arg(ttl_ms)
                    .query_async(&mut redis),
            )
            .await?;
            if set.is_some() {
                let mut guard = RedisGuard {
                    fences: self.fences.clone(),
                    redis: redis.clone(),
                    key,
                    token,
                    fence_name: name.bounded(MAX_STORED_NAME, false).into_owned(),
                    fence: 0,
                    released: false,
                };
                let backend = self.fences.get_database_backend();
                let reply = crate::db::deadline::reply_bound(ttl);
                guard.fence =
                    fence::bump(&self.fences, backend, KIND, &guard.fence_name, reply).await?;
                return Ok(Some(Box::new(guard)));
            }
            if !backoff.wait_until(deadline).await {
                return Ok(None);
            }
        }
    }
}

/// A Redis lease.
struct RedisGuard {
    fences: sea_orm::DatabaseConnection,
    redis: ConnectionManager,
    key: String,
    token: String,
    fence_name: String,
    fence: u64,
    released: bool,
}

impl std::fmt::Debug for RedisGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisGuard")
            .field("key", &self.key)
            .field("fence", &self.fence)
            .finish_non_exhaustive()
    }
}

impl RedisGuard {
    async fn release_now(
        mut redis: ConnectionManager,
        key: &str,
        token: &str,
    ) -> Result<bool, LockError> {
        let deleted: i64 = call(
            Script::new(RELEASE)
                .key(key)
                .arg(token)
                .invoke_async(&mut redis),
        )
        .await?;
        Ok(deleted == 1)
    }
}

#[async_trait]
impl LockGuard for RedisGuard {
    fn fencing(&self) -> Option<&dyn Fencing> {
        Some(self)
    }

    fn renewal(&self) -> Option<&dyn Renewal> {
        Some(self)
    }

    async fn retire(self: Box<Self>) -> Result<(), LockError> {
        // While the Redis lease is held: no other grant bumps the row meanwhile.
        if let Err(error) = fence::retire(&self.fences, KIND, &self.fence_name, self.fence).await {
            tracing::warn!(key = %self.key, %error, "deleting the fence row of a missing key failed");
        }
        self.release().await
    }

    async fn release(mut self: Box<Self>) -> Result<(), LockError> {
        self.released = true;
        Self::release_now(self.redis.clone(), &self.key, &self.token)
            .await
            .map(drop)
    }
}

#[async_trait]
impl Fencing for RedisGuard {
    fn fence(&self) -> u64 {
        self.fence
    }

    async fn verify(&self, txn: &DatabaseTransaction) -> Result<bool, LockError> {
        fence::verify(txn, KIND, &self.fence_name, self.fence).await
    }

    fn fence_row(&self) -> Option<&str> {
        Some(&self.fence_name)
    }
}

#[async_trait]
impl Renewal for RedisGuard {
    async fn extend(&self, ttl: Duration) -> Result<bool, LockError> {
        let mut redis = self.redis.clone();
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
        let extended: i64 = call(
            Script::new(EXTEND)
                .key(&self.key)
                .arg(&self.token)
                .arg(ttl_ms)
                .invoke_async(&mut redis),
        )
        .await?;
        Ok(extended == 1)
    }
}

impl Drop for RedisGuard {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        let (redis, key, token) = (self.redis.clone(), self.key.clone(), self.token.clone());
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = Self::release_now(redis, &key, &token).await;
            });
        }
    }
}
