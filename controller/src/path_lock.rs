//! Locks on paths, within this process: work that writes one directory (a build of one hash, a
//! checkout of one commit) runs once at a time, and whoever waited finds it done.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{Arc, OnceLock, Weak},
};

/// The lock of `path`; hold its guard while writing there.
pub fn of(path: &Path) -> Arc<tokio::sync::Mutex<()>> {
    static LOCKS: OnceLock<parking_lot::Mutex<HashMap<PathBuf, Weak<tokio::sync::Mutex<()>>>>> =
        OnceLock::new();
    let mut locks = LOCKS.get_or_init(Default::default).lock();
    // Locks nobody holds or waits for any more go.
    locks.retain(|_, lock| lock.strong_count() > 0);
    if let Some(lock) = locks.get(path).and_then(Weak::upgrade) {
        return lock;
    }
    let lock = Arc::new(tokio::sync::Mutex::new(()));
    locks.insert(path.to_path_buf(), Arc::downgrade(&lock));
    lock
}

#[cfg(test)]
mod tests {
    use super::of;
    use std::path::Path;

    #[tokio::test]
    async fn one_path_one_lock_while_it_is_held() {
        let first = of(Path::new("/a"));
        let _held = first.lock().await;
        assert!(of(Path::new("/a")).try_lock().is_err(), "the same lock");
        assert!(
            of(Path::new("/b")).try_lock().is_ok(),
            "another path, another lock"
        );
    }
}
